"""HTA's reading of one trace, run under HTA's own interpreter by ``compare_hta_device_time.py``.

    python hta_reading.py FOLDER [KERNEL_NAME ...]

FOLDER holds the one trace; the kernel names are asked of HTA's typing directly. Prints one line
``HTA-JSON {...}`` on stdout; HTA's own logging (to stdout) is captured, not printed. A separate
file because it runs in another interpreter (HTA's, with its own pandas), not this project's.
"""

import contextlib
import json
import logging
import sys
import traceback

folder, probes = sys.argv[1], sys.argv[2:]
out = sys.stdout
result = {"messages": [], "rounding": {"events": 0, "trimmed_us": 0.0}}


class Keep(logging.Handler):
    def emit(self, record):
        result["messages"].append(record.getMessage()[:200])


def failed(stage, exc):
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/hta/" in f.filename]
    where = f" in {frames[-1].name}" if frames else ""
    line = (str(exc).strip().splitlines() or [""])[0]
    result["error"] = f"{stage}{where}: {type(exc).__name__}: {line}"


def on_stream(args):
    try:
        return isinstance(args, dict) and int(args.get("stream", -1)) != -1
    except (TypeError, ValueError):
        return False


with contextlib.redirect_stdout(sys.stderr):
    stage = "import"
    try:
        # pandas first, as HTA imports it: without it, that is the error to report.
        import pandas  # noqa: I001
        import hta
        import hta.common.trace_parser as parser
        from hta.trace_analysis import TraceAnalysis
        from hta.utils.utils import get_kernel_type

        result["versions"] = {"hta": getattr(hta, "__version__", "?"), "pandas": pandas.__version__}
        for name in ("hta", None):
            logging.getLogger(name).handlers = [Keep()]
        result["probes"] = {n: get_kernel_type(n) for n in probes}

        # Observe (not change) HTA's rounding of ns timestamps: what it trims off GPU events.
        original = getattr(parser, "round_down_time_stamps", None)
        if original is not None:

            def observed(df):
                floats = "ts" in df.columns and df["ts"].dtype.kind == "f"
                before = df["dur"].copy() if floats and "dur" in df.columns else None
                original(df)
                if before is not None and "args" in df.columns:
                    gpu = df["args"].map(on_stream) & df["dur"].notna()
                    result["rounding"] = {
                        "events": int(gpu.sum()),
                        "trimmed_us": float((before - df["dur"])[gpu].sum()),
                    }

            parser.round_down_time_stamps = observed

        stage = "TraceAnalysis"
        analyzer = TraceAnalysis(trace_dir=folder)
        trace = analyzer.t
        sym = trace.symbol_table.get_sym_table()
        result["profiler_step_names"] = sum(1 for s in sym if "ProfilerStep" in str(s))
        df = trace.traces[sorted(trace.traces)[0]]
        gpu = df[df["stream"].ne(-1)]
        events = {}
        # No zip(strict=): HTA's interpreter may be older than this project's.
        for cat, name, dur in zip(gpu["cat"], gpu["name"], gpu["dur"]):  # noqa: B905
            key = (sym[cat], sym[name])
            entry = events.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += float(dur)
        result["events"] = [
            [cat, name, get_kernel_type(name), n, us] for (cat, name), (n, us) in events.items()
        ]
        annotations = df[df["cat"].map(lambda c: sym[c] == "gpu_user_annotation")]
        result["annotations_without_stream"] = int(annotations["stream"].eq(-1).sum())

        stage = "get_temporal_breakdown"
        row = analyzer.get_temporal_breakdown(visualize=False).iloc[0]
        result["temporal"] = {
            k: float(row[k])
            for k in (
                "idle_time(us)",
                "compute_time(us)",
                "non_compute_time(us)",
                "kernel_time(us)",
            )
        }

        stage = "get_gpu_kernel_breakdown"
        kinds, _ = analyzer.get_gpu_kernel_breakdown(visualize=False, include_memory_kernels=True)
        sums = zip(kinds["kernel_type"], kinds["sum"])  # noqa: B905
        result["kinds"] = {str(k): float(s) for k, s in sums}
    except Exception as exc:
        failed(stage, exc)

out.write("HTA-JSON " + json.dumps(result) + "\n")
