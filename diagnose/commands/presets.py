"""`diagnose presets`: the model presets and their parameter counts (counted on the meta device
when the configs were written; see scripts/preset_counts)."""

from __future__ import annotations

import argparse

from diagnose.errors import ExitCode


class PresetsCommand:
    name = "presets"
    help = "list the model presets with their parameter counts"

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, args: argparse.Namespace) -> int:
        from diagnose.config import PRESETS, SIZES
        from diagnose.workload.presets import preset_counts

        # The counts are read from the file the configs come with (nothing is built: listing
        # the presets imports no torch and answers at once).
        counts = preset_counts()
        print(f"{'preset':8} {'size':5} {'denoiser':32} {'parameters':>14} {'LoRA trainable':>15}")
        for preset in PRESETS:
            for size in SIZES:
                info = counts[(preset, size)]
                print(
                    f"{preset:8} {size:5} {info.class_name:32} {info.parameters:>14,} "
                    f"{info.trainable_parameters:>15,}"
                )
        return int(ExitCode.OK)
