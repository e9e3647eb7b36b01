"""`diagnose presets`: the model presets and their parameter counts (built on the meta device)."""

from __future__ import annotations

import argparse

from diagnose.errors import ExitCode


class PresetsCommand:
    name = "presets"
    help = "list the model presets with their parameter counts (nothing is allocated)"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, args: argparse.Namespace) -> int:
        from diagnose.config import PRESETS, SIZES
        from diagnose.workload import describe_preset

        print(f"{'preset':8} {'size':5} {'denoiser':32} {'parameters':>14} {'LoRA trainable':>15}")
        for preset in PRESETS:
            for size in SIZES:
                info = describe_preset(preset, size)
                print(
                    f"{preset:8} {size:5} {info.class_name:32} {info.parameters:>14,} "
                    f"{info.trainable_parameters:>15,}"
                )
        return int(ExitCode.OK)
