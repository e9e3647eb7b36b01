"""Redaction end to end: what a real run writes and prints must be safe to attach to a ticket.

Secrets are planted where users have them: a hub token and an API key in the environment, a
password in a URL held by a recorded variable and by the proxy setting, a token-like folder name
in the ``--data`` path (so it lands in the command line and the config), and a probe whose error
message and traceback carry a token and a URL password. None of them may appear in record.json,
report.html or the terminal output.

Two layers: ``redact_record`` applied to a real ``execute_run`` record (passes now), and the CLI
``main(["run", ...])`` (passes once ``execute_run`` calls ``redact_record`` before saving; until
then it is an expected failure).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from diagnose.cli import main
from diagnose.config import RunConfig
from diagnose.probes.base import ProbeContext
from diagnose.probes.environment.probe import EnvironmentProbe
from diagnose.record import ProbeResult, RunRecord
from diagnose.record_io import load_record
from diagnose.redact import MASK, redact_record
from diagnose.workload.synthetic_images import generate_images

HF_TOKEN = "hf_" + "Qw3rTyUiOpAsDfGhJkLzXcVbNm0123456789"
FOLDER_TOKEN = "hf_" + "ZyXwVuTsRqPoNmLkJiHgFeDcBa9876543210"
API_KEY = "k3y-live-7f3a9c2b1d8e4f60"
PASSWORD = "pr0xy-Passw0rd-42"
SECRETS = (HF_TOKEN, FOLDER_TOKEN, API_KEY, PASSWORD)

QUICK = ["--steps", "2", "--warmup", "0", "--profiled-steps", "1", "--no-progress"]


def plant_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("MY_API_KEY", API_KEY)
    monkeypatch.setenv("HTTPS_PROXY", f"http://alice:{PASSWORD}@proxy.example:3128")
    # A recorded (DIFFUSERS_-prefixed) variable whose value holds credentials.
    monkeypatch.setenv("DIFFUSERS_MIRROR_URL", f"https://bob:{PASSWORD}@mirror.example/models")


def data_folder(root: Path) -> Path:
    """An image folder whose path carries a token and the API key (people name folders oddly)."""
    folder = root / "datasets" / FOLDER_TOKEN / f"set-{API_KEY}"
    generate_images(folder, count=2, size=(160, 128))
    return folder


class LeakyProbe:
    """A probe failing with credentials in its message, as a failed hub download would."""

    name = "leaky"
    description = "fails with secrets in the error"
    requires_packages: tuple[str, ...] = ()
    device_kinds: tuple[str, ...] = ()

    def run(self, ctx: ProbeContext) -> ProbeResult:
        url = f"https://user:{PASSWORD}@hub.example/api?token={HF_TOKEN}"
        raise ConnectionError(f"cannot reach {url} (Authorization: Bearer {HF_TOKEN})")


def assert_clean(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret[:6]}… leaked into {where}"


@dataclass
class RedactedRun:
    plain: RunRecord
    paths_too: RunRecord
    folder: Path
    #: The home folder during the run: the run's own temporary folder, so the record holds a
    #: path under it wherever Python and the venv live (under $HOME or not).
    home: str


@pytest.fixture(scope="module")
def redacted_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedactedRun]:
    """One real tiny run with the secrets planted. execute_run redacts the record before it
    saves or returns it, while the secrets are still set (the redactor masks the values of the
    secret-named variables set at the time it runs); the masks in the checks below show that the
    secrets did reach the record and were replaced."""
    from diagnose.run import execute_run

    root = tmp_path_factory.mktemp("redaction")
    with pytest.MonkeyPatch.context() as monkeypatch:
        plant_environment(monkeypatch)
        monkeypatch.setenv("HOME", str(root))
        folder = data_folder(root)
        config = RunConfig(device="cpu", steps=2, warmup=0, profiled_steps=1, data_dir=str(folder))
        out = root / "out"
        out.mkdir()
        outputs = execute_run(config, out, probes=[EnvironmentProbe(), LeakyProbe()])
        paths_too = redact_record(outputs.record, redact_paths=True)
    yield RedactedRun(outputs.record, paths_too, folder, str(root))


def test_redact_record_removes_every_secret(
    redacted_run: RedactedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from diagnose.reports import terminal_summary, write_html

    record = redacted_run.plain
    record.save(tmp_path / "record.json")
    write_html(record, tmp_path / "report.html")
    print(terminal_summary(record, color=False))
    assert_clean((tmp_path / "record.json").read_text(encoding="utf-8"), "record.json")
    assert_clean((tmp_path / "report.html").read_text(encoding="utf-8"), "report.html")
    out, err = capsys.readouterr()
    assert_clean(out + err, "the terminal")

    # Still a valid, loadable record with the masks where the secrets were.
    loaded = load_record(tmp_path / "record.json")
    assert loaded.config["data_dir"].endswith(f"hf_{MASK}/set-{MASK}")
    assert f"hf_{MASK}" in loaded.command
    assert (
        loaded.inventory["env"]["DIFFUSERS_MIRROR_URL"] == f"https://{MASK}@mirror.example/models"
    )
    assert "HF_TOKEN" not in loaded.inventory["env"] and "MY_API_KEY" not in loaded.inventory["env"]
    leaky = next(p for p in loaded.probes if p.name == "leaky")
    assert leaky.status == "error" and "ConnectionError" in leaky.reason
    assert "Bearer ***" in leaky.reason and "https://***@hub.example" in leaky.traceback
    # Numbers are untouched.
    assert loaded.timing.samples[0].seconds == redacted_run.paths_too.timing.samples[0].seconds


def test_redact_paths_also_hides_home_and_user(redacted_run: RedactedRun) -> None:
    home = redacted_run.home
    # Not replaced without the option, and redact_record left its input as it was.
    assert home in redacted_run.plain.to_json()  # the data folder lies under it
    text = redacted_run.paths_too.to_json()
    assert_clean(text, "the --redact-paths record")
    assert home not in text
    assert "~/" in text


def test_cli_run_writes_and_prints_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    plant_environment(monkeypatch)
    folder = data_folder(tmp_path)
    out = tmp_path / "out"
    # The probes that print or record paths, packages and the environment run; the A/B-only
    # probes (their numbers hold no strings from the machine) are off to keep the test short.
    skip = ["--skip", "attention", "--skip", "optimizer", "--skip", "precision"]
    assert main(["run", "--out", str(out), "--data", str(folder), *QUICK, *skip]) == 0
    printed_out, printed_err = capfd.readouterr()
    assert_clean(printed_out + printed_err, "the terminal")
    # The clean twin of test_cli's library-chatter test: nothing printed, nothing said about it.
    assert "--verbose shows them" not in printed_out and printed_err == ""
    assert_clean((out / "record.json").read_text(encoding="utf-8"), "record.json")
    assert_clean((out / "report.html").read_text(encoding="utf-8"), "report.html")
    record = json.loads((out / "record.json").read_text(encoding="utf-8"))
    assert MASK in record["config"]["data_dir"]


def test_cli_run_with_redact_paths_hides_the_host_in_the_record_and_the_trace(
    tmp_path: Path,
) -> None:
    """Kineto writes the host name into the trace, and the trace analysis copies it into the
    record; with --redact-paths neither keeps it (the trace is rewritten, still a valid trace)."""
    import gzip
    import socket

    out = tmp_path / "out"
    # The host name is in the trace and in what the trace rules copy: the probes are not needed.
    skip = [a for p in ("precision", "attention", "dataloader", "optimizer") for a in ("--skip", p)]
    assert main(["run", "--out", str(out), "--redact-paths", *QUICK, *skip]) == 0
    trace = json.loads(gzip.decompress((out / "trace.json.gz").read_bytes()))
    assert trace["host_name"] == "<host>" and trace["traceEvents"]
    record = load_record(out)
    host_fields = record.probes[0].data["metadata"]["trace_fields"]
    assert host_fields["host_name"] == "<host>"
    host = socket.gethostname()
    if len(host) >= 5:  # shorter names are masked in host fields only
        assert host not in (out / "record.json").read_text(encoding="utf-8")
    # The rewritten trace still reads as a trace.
    from diagnose.trace.analysis import analyze_trace

    assert analyze_trace(out / "trace.json.gz").steps
