"""`diagnose env`: the machine inventory (device, versions, performance-relevant settings)."""

from __future__ import annotations

import argparse
import json

from diagnose.errors import ExitCode


class EnvCommand:
    name = "env"
    help = (
        "print the device, software versions and performance-relevant settings (secrets redacted)"
    )

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")

    def run(self, args: argparse.Namespace) -> int:
        import dataclasses

        from diagnose.device import describe_device, select_device
        from diagnose.inventory import collect_inventory
        from diagnose.telemetry import read_telemetry_once

        device_info = describe_device(select_device(args.device))
        document = {
            "device": dataclasses.asdict(device_info),
            "inventory": collect_inventory(device_info.kind),
            "telemetry_now": read_telemetry_once(device_info).to_dict(),
        }
        print(json.dumps(document, indent=2, sort_keys=True, default=str))
        return int(ExitCode.OK)
