"""A plain LoRA training loop with one performance fault planted at a time, timed without the
profiler (the truth) against what ``diagnose trace`` reads from a profiled trace of the same loop.

    python benchmarks/planted_faults.py --out DIR [--device cuda] [--size full|tiny] [--steps 20]
                                        [--faults fp32-upcast,math-sdpa,...] [--budget S]
    python benchmarks/planted_faults.py --train FAULT [--steps N]   # the loop alone, to run under
                                                                     # diagnose profile -- ...

The loop is the one of the project's first GPU run: transformer blocks over patch tokens, a frozen
bf16 base with fp32 LoRA adapters under bf16 autocast, a DataLoader (num_workers=0) handing
pre-decoded images, torch AdamW (fused). Each fault changes one thing (:data:`FAULTS`); the clean
loop (``none``) is every fault's twin, so a fault's measured saving is its median step less the
clean loop's, and the clean loop's own diagnosis must stay quiet about every fault's finding.

With ``--out`` each loop runs ``--steps`` steps timed without the profiler (the device synchronised
at the end of each), then 3 profiled ones into ``DIR/traces/FAULT.json``, which ``diagnose trace``
reads into ``DIR/diagnosis/FAULT/``. Written: ``DIR/faults.md`` (one table: fault, found?,
severity, estimated saving, measured saving, ratio, whether the clean twin stayed quiet) and
``DIR/faults.json`` (the same rows, each loop's step times). ``--profile FAULT,...``: those
faults are also trained under ``diagnose profile`` (the loop unmodified, in its own process), its
verdict in the table's last column. A loop that would start after ``--budget`` seconds is not run
and its row says so. Exit status 0; 2 on misuse.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diagnose.offline import hub_offline


@dataclass(frozen=True)
class PlantedFault:
    name: str
    #: What the fault changes in the clean loop, as the table says it.
    what: str
    #: The finding ids that name it (any one of them is a find).
    finding_ids: tuple[str, ...]


SYNC = ("compute.sync_in_step", "optimizer.sync_in_step")
FAULTS: dict[str, PlantedFault] = {
    fault.name: fault
    for fault in (
        PlantedFault("none", "the clean loop, every fault's twin", ()),
        PlantedFault(
            "fp32-upcast",
            "each block's MLP in fp32 (autocast off, fp32 base weights)",
            ("precision.fp32_compute_in_low_precision_run",),
        ),
        PlantedFault("math-sdpa", "SDPA held to its math backend", ("attention.math_fallback",)),
        PlantedFault(
            "hand-attention", "attention written as softmax(QK^T)V", ("attention.unfused_manual",)
        ),
        PlantedFault(
            "slow-loader",
            "the DataLoader decodes and resizes large JPEGs in the loop's process",
            ("dataloader.gpu_starved",),
        ),
        PlantedFault("clipping", ".item() on each gradient's norm before the step", SYNC),
        PlantedFault("logging", "loss.item() after the step", SYNC),
        PlantedFault("forward-cpu", "a .cpu() in every block's forward", SYNC),
        PlantedFault(
            "adamw8bit",
            "bitsandbytes AdamW8bit instead of torch AdamW (fused)",
            ("optimizer.sync_in_step", "optimizer.slower_than_alternative"),
        ),
        PlantedFault(
            "nf4-base", "the frozen base stored NF4 (bitsandbytes)", ("quantization.dequant_cost",)
        ),
    )
}
#: The faults the GPU check plants, each alone.
SUITE = (
    "fp32-upcast",
    "math-sdpa",
    "hand-attention",
    "slow-loader",
    "clipping",
    "adamw8bit",
    "nf4-base",
)
#: blocks, width, batch, pixels, images
SIZES = {"full": (8, 1024, 8, 256, 8), "tiny": (2, 64, 2, 64, 4)}
PROFILED = 3
WARMUP = 3


def train(
    fault: str, size: str, device: str, steps: int, trace: Path | None, *, warmup: int = WARMUP
) -> list[float]:
    """Train ``warmup`` steps, ``steps`` timed ones (and 3 profiled ones into ``trace``); the
    timed seconds."""
    import numpy as np
    import torch
    from PIL import Image

    blocks, width, batch, pixels, images = SIZES[size]
    patch = 8
    dev = torch.device(device)
    folder = Path(tempfile.mkdtemp(prefix="planted-faults-"))
    rng = np.random.default_rng(0)
    # The slow loader decodes photos of twice the side and resizes them, as a trainer's buckets do.
    side = 2 * pixels if fault == "slow-loader" else pixels
    for i in range(images):
        array = rng.integers(0, 255, (side, side, 3), dtype=np.uint8)
        Image.fromarray(array).save(folder / f"{i}.jpg", quality=95)

    def decode(index: int) -> torch.Tensor:
        data = io.BytesIO((folder / f"{index % images}.jpg").read_bytes())
        image = Image.open(data).convert("RGB").resize((pixels, pixels), Image.Resampling.LANCZOS)
        array = np.asarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()

    decoded = [decode(i) for i in range(images)]

    class Photos(torch.utils.data.Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return images

        def __getitem__(self, index: int) -> torch.Tensor:
            return decode(index) if fault == "slow-loader" else decoded[index]

    class Lora(torch.nn.Module):
        def __init__(self, base: torch.nn.Linear, rank: int = 16) -> None:
            super().__init__()
            self.base: torch.nn.Module = base.requires_grad_(False)
            self.down = torch.nn.Linear(base.in_features, rank, bias=False)
            self.up = torch.nn.Linear(rank, base.out_features, bias=False)
            torch.nn.init.zeros_(self.up.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.up(self.down(x))  # type: ignore[no-any-return]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if fault == "hand-attention":
            scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
            return scores.softmax(dim=-1) @ v
        if fault == "math-sdpa":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.MATH):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            self.qkv = Lora(torch.nn.Linear(width, 3 * width))
            self.out = Lora(torch.nn.Linear(width, width))
            self.mlp_in = Lora(torch.nn.Linear(width, 4 * width))
            self.mlp_out = Lora(torch.nn.Linear(4 * width, width))

        def mlp(self, x: torch.Tensor) -> torch.Tensor:
            if fault == "fp32-upcast":
                with torch.autocast(dev.type, enabled=False):
                    h = self.mlp_out(torch.nn.functional.gelu(self.mlp_in(x.float())))
                return h.to(x.dtype)  # type: ignore[no-any-return]
            return self.mlp_out(torch.nn.functional.gelu(self.mlp_in(x)))  # type: ignore[no-any-return]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, _ = x.shape
            heads = max(width // 64, 1)
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4)
            x = x + self.out(attention(q, k, v).transpose(1, 2).reshape(b, n, width))
            x = x + self.mlp(self.norm2(x))
            if fault == "forward-cpu":
                x.detach()[0, 0, :4].cpu()
            return x

    embed = torch.nn.Conv2d(3, width, patch, stride=patch)
    model = torch.nn.ModuleDict(
        {"embed": embed, "blocks": torch.nn.ModuleList(Block() for _ in range(blocks))}
    )
    head = torch.nn.Linear(width, 3 * patch * patch)
    model.to(dev, torch.bfloat16).requires_grad_(False)
    head.to(dev, torch.bfloat16).requires_grad_(False)
    adapters = [m for m in model.modules() if isinstance(m, Lora)]
    if fault == "fp32-upcast":
        for block in model["blocks"]:
            block.mlp_in.base.float()
            block.mlp_out.base.float()
    if fault == "nf4-base":
        from diagnose.workload.quantize import quantize_linears

        stored = torch.nn.ModuleList(m.base for m in adapters)
        quantize_linears(stored, "nf4", torch.bfloat16, dev)
        for adapter, base in zip(adapters, stored, strict=True):
            adapter.base = base
    trained = [p for m in adapters for p in (*m.down.parameters(), *m.up.parameters())]
    for param in trained:
        param.data = param.data.float()
        param.requires_grad_(True)
    if fault == "adamw8bit":
        import bitsandbytes

        optimizer: Any = bitsandbytes.optim.AdamW8bit(trained, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=True)
    loader = torch.utils.data.DataLoader(
        Photos(), batch_size=batch, num_workers=0, pin_memory=dev.type == "cuda"
    )
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16)

    def step(images_: torch.Tensor) -> None:
        pixels_ = images_.to(dev, non_blocking=True)
        with autocast:
            x = model["embed"](pixels_.to(torch.bfloat16)).flatten(2).transpose(1, 2)
            for block in model["blocks"]:
                x = block(x)
            out = head(x)
            target = torch.nn.functional.unfold(pixels_, patch, stride=patch).transpose(1, 2)
            loss = torch.nn.functional.mse_loss(out.float(), target)
        loss.backward()
        if fault == "clipping":
            for p in trained:
                if p.grad is not None:
                    p.grad.norm().item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if fault == "logging":
            loss.item()

    def batches() -> Any:
        while True:
            yield from loader

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    source = batches()
    for _ in range(warmup):
        step(next(source))
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(next(source))
        sync()
        times.append(time.perf_counter() - start)
    if trace is not None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if dev.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=PROFILED, repeat=1)
        with torch.profiler.profile(
            activities=activities, schedule=schedule, record_shapes=True
        ) as prof:
            for _ in range(PROFILED + 1):
                step(next(source))
                prof.step()
        sync()
        prof.export_chrome_trace(str(trace))
    shutil.rmtree(folder, ignore_errors=True)
    return times


# --------------------------------------------------------------------------------------------
# The suite: each fault alone against the clean loop, diagnosed by diagnose trace


@dataclass
class FaultRow:
    fault: str
    what: str
    ran: bool = False
    #: Why the fault was not run or not diagnosed; empty when it was.
    note: str = ""
    step_seconds: list[float] = field(default_factory=list)
    found: bool = False
    finding_id: str = ""
    severity: str = ""
    estimated_saving_s: float | None = None
    measured_saving_s: float | None = None
    #: The clean loop's diagnosis names none of this fault's findings (None: not diagnosed).
    twin_quiet: bool | None = None
    #: ``diagnose profile`` of the loop names it (None: not profiled), and its estimate.
    profile_found: bool | None = None
    profile_saving_s: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.estimated_saving_s is None or not self.measured_saving_s:
            return None
        return self.estimated_saving_s / self.measured_saving_s


def _findings(trace: Path, out: Path) -> list[dict[str, Any]]:
    """``diagnose trace TRACE --out OUT``, as a user runs it; the record's findings."""
    from diagnose.cli import main as diagnose

    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f"{out.name}.log").open("w", encoding="utf-8") as log, redirect_stdout(log):
        code = diagnose(["trace", str(trace), "--out", str(out), "--force", "--jobs", "1"])
    if code != 0:
        raise RuntimeError(f"diagnose trace exited {code}")
    record = json.loads((out / "record.json").read_text(encoding="utf-8"))
    return list(record.get("findings", []))


def _profiled(fault: str, size: str, device: str, out: Path, timeout_s: float) -> list[Any]:
    """``diagnose profile`` of the loop with ``fault``, unmodified, as a user runs it."""
    command = [
        *(sys.executable, "-m", "diagnose", "profile", "--stop-after", "--skip-steps", "2"),
        *("--steps", "5", "--out", str(out), "--force", "--no-stacks", "--"),
        *(sys.executable, __file__, "--train", fault, "--device", device, "--size", size),
        *("--steps", "100000"),
    ]
    with (out.parent / f"{out.name}.log").open("w", encoding="utf-8") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    record = json.loads((out / "record.json").read_text(encoding="utf-8"))
    return list(record.get("findings", []))


def _named(findings: list[dict[str, Any]], fault: PlantedFault) -> dict[str, Any] | None:
    named = [f for f in findings if f.get("id") in fault.finding_ids]
    return max(named, key=lambda f: f.get("est_seconds_saved_per_it") or 0.0, default=None)


def run_suite(
    faults: list[str],
    *,
    size: str,
    device: str,
    steps: int,
    warmup: int = WARMUP,
    out: Path,
    budget: float,
    profiled: tuple[str, ...] = (),
) -> list[FaultRow]:
    """Run the clean loop and each fault in ``faults``, diagnose each trace; one row per fault.
    The faults in ``profiled`` are also run under ``diagnose profile``, each in its own process."""
    import torch

    started = time.perf_counter()
    (out / "traces").mkdir(parents=True, exist_ok=True)
    measured: dict[str, list[float]] = {}
    diagnosed: dict[str, list[dict[str, Any]]] = {}
    notes: dict[str, str] = {}
    # The process's first loop pays torch's lazy start (threads, allocator, kernels' first
    # loads): a short untimed one, so the clean loop's timing does not carry it.
    train("none", size, device, 1, None)
    for name in ("none", *faults):
        if time.perf_counter() - started > budget:
            notes[name] = f"not run: the suite's {budget:.0f} s budget was spent"
            continue
        trace = out / "traces" / f"{name}.json"
        try:
            measured[name] = train(name, size, device, steps, trace, warmup=warmup)
            diagnosed[name] = _findings(trace, out / "diagnosis" / name)
        except Exception as exc:  # one fault's failure is its row's, not the suite's
            notes[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    # The clean loop again, last: every fault is held against both of its timings, so a machine
    # that slowed or sped up while the suite ran does not fall on the faults alone.
    if "none" in measured and time.perf_counter() - started <= budget:
        measured["none"] += train("none", size, device, steps, None, warmup=warmup)
    by_profile: dict[str, list[Any]] = {}
    (out / "profile").mkdir(exist_ok=True)
    for name in profiled:
        left = budget - (time.perf_counter() - started)
        if name in faults and left > 10:
            try:
                by_profile[name] = _profiled(name, size, device, out / "profile" / name, left)
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                notes[name] = f"diagnose profile failed: {type(exc).__name__}: {str(exc)[:200]}"
    clean = measured.get("none")
    rows = []
    for name in faults:
        fault = FAULTS[name]
        row = FaultRow(name, fault.what, note=notes.get(name, ""))
        row.step_seconds = measured.get(name, [])
        row.ran = name in diagnosed
        if row.ran:
            finding = _named(diagnosed[name], fault)
            row.found = finding is not None
            if finding is not None:
                row.finding_id = str(finding.get("id"))
                row.severity = str(finding.get("severity", ""))
                row.estimated_saving_s = finding.get("est_seconds_saved_per_it")
        if clean and row.step_seconds:
            row.measured_saving_s = statistics.median(row.step_seconds) - statistics.median(clean)
        if "none" in diagnosed:
            row.twin_quiet = _named(diagnosed["none"], fault) is None
        if name in by_profile:
            named = _named(by_profile[name], fault)
            row.profile_found = named is not None
            row.profile_saving_s = None if named is None else named.get("est_seconds_saved_per_it")
        if "none" in notes and not row.note:
            row.note = f"clean twin {notes['none']}"
        rows.append(row)
    return rows


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _profile_cell(row: FaultRow) -> str:
    if row.profile_found is None:
        return "–"
    return f"found, {_ms(row.profile_saving_s)}" if row.profile_found else "not found"


def table(rows: list[FaultRow]) -> str:
    """The suite's one table, in Markdown."""
    lines = [
        "| fault | what | found? | severity | estimated saving | measured saving | ratio "
        "| clean twin quiet? | diagnose profile |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        found = ("yes: " + row.finding_id) if row.found else ("no" if row.ran else row.note)
        ratio = "–" if row.ratio is None else f"{row.ratio:.2f}"
        quiet = {True: "yes", False: "no", None: "–"}[row.twin_quiet]
        lines.append(
            f"| {row.fault} | {row.what} | {found} | {row.severity or '–'} "
            f"| {_ms(row.estimated_saving_s)} | {_ms(row.measured_saving_s)} | {ratio} "
            f"| {quiet} | {_profile_cell(row)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own)")
    parser.add_argument("--faults", default=",".join(SUITE))
    parser.add_argument("--out", type=Path, help="run the suite into this folder")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds for the suite")
    parser.add_argument("--train", choices=sorted(FAULTS), help="train the loop alone")
    parser.add_argument("--profile", default="", help="faults also run under diagnose profile")
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f and f != "none"]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if (
        args.steps < 1
        or args.warmup < 0
        or any(f not in FAULTS for f in faults)
        or not (args.train or args.out)
    ):
        parser.print_usage(sys.stderr)
        return 2
    if args.train:
        with hub_offline():
            train(args.train, args.size, args.device, args.steps, None)
        return 0
    out: Path = args.out
    with hub_offline():
        rows = run_suite(
            faults,
            size=args.size,
            device=args.device,
            steps=args.steps,
            out=out,
            budget=args.budget,
            profiled=tuple(f for f in args.profile.split(",") if f),
        )
    text = table(rows)
    (out / "faults.md").write_text(text, encoding="utf-8")
    document = [{**asdict(row), "ratio": row.ratio} for row in rows]
    (out / "faults.json").write_text(json.dumps(document, indent=1), encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
