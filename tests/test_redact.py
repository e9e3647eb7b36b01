"""Redaction: records and reports are attached to public tickets."""

from __future__ import annotations

from typing import Any

import pytest

from diagnose.record import Finding, ProbeResult, RunRecord, StepSample
from diagnose.redact import (
    MASK,
    Redactor,
    is_secret_name,
    make_redactor,
    redact_obj,
    redact_record,
    redact_text,
    secret_env_values,
)

HF = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"


@pytest.mark.parametrize(
    "name",
    [
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "hf_token",
        "MY_API_KEY",
        "OPENAI_API_KEY",
        "apiKey",
        "HFTOKEN",
        "AWS_SECRET_ACCESS_KEY",
        "DB_PASSWORD",
        "DB_PASS",
        "PGPASSWD",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "AUTH",
        "COOKIE",
        "SESSION_ID",
        "TRITON_API_KEY",  # secret even under a performance prefix
        "PYTORCH_SECRET",
    ],
)
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "KEYBOARD_LAYOUT",
        "key",  # a probe's "key": "cached_latents" in its A/B table
        "keys",
        "TOKENIZERS_PARALLELISM",
        "MAX_TOKEN_LENGTH",
        "max_token_length",  # sd-scripts' --max_token_length 225
        "DESKTOP_SESSION",  # value "ubuntu" would mask the distro name
        "GDMSESSION",
        "KeyError",
        "BYPASS_CACHE",
        "PYTORCH_CUDA_ALLOC_CONF",
        "HIP_VISIBLE_DEVICES",
        "PATH",
        "",
    ],
)
def test_harmless_names(name: str) -> None:
    assert not is_secret_name(name)


def test_masks_hf_tokens_and_url_credentials_in_arbitrary_text() -> None:
    text = f"login with {HF} then fetch http://user:pass@host:3128/x and https://tok@github.com/a"
    out = redact_text(text)
    assert HF not in out
    assert "hf_" + MASK in out
    assert "user:pass" not in out
    assert "http://***@host:3128/x" in out
    assert "https://***@github.com/a" in out


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("key sk-proj-abcdefghijklmnopqrstuvwx1234", "abcdefghijklmnopqrstuvwx1234"),
        ("ghp_abcdefghijklmnopqrstuvwxyz0123456789", "abcdefghijklmnopqrstuvwxyz0123456789"),
        ("aws AKIAIOSFODNN7EXAMPLE", "IOSFODNN7EXAMPLE"),
        ("train.py --token s3cr3tvalue --lr 1e-4", "s3cr3tvalue"),
        ("train.py --api-key=s3cr3tvalue", "s3cr3tvalue"),
        ("train.py --hf_token 'quoted-secret'", "quoted-secret"),
        ("https://example.org/dl?token=s3cr3tvalue&x=1", "s3cr3tvalue"),
        ('{"password": "hunter2hunter2"}', "hunter2hunter2"),
        ("Authorization: Bearer abcdefghijklmnop", "abcdefghijklmnop"),
        (
            "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXk\n"
            "-----END OPENSSH PRIVATE KEY-----",
            "b3BlbnNzaC1rZXk",
        ),
    ],
)
def test_masks_token_shapes_and_secret_arguments(text: str, secret: str) -> None:
    assert secret not in redact_text(text)


@pytest.mark.parametrize(
    "text",
    [
        "accelerate launch train.py --max_token_length 225 --lr 1e-4 --rank 32",
        "KeyError: 'gfx1100'",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "torch 2.9.0+rocm6.4 HIP 6.4.43482-0f2d60242 cuDNN 9.1.0",
        "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'",
        "the tokenizer has 49408 tokens",
    ],
)
def test_leaves_ordinary_text_alone(text: str) -> None:
    assert redact_text(text) == text


def test_masks_values_of_secret_named_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_API_KEY", "abcdef123456")
    monkeypatch.setenv("FOO_AUTH", "1")  # too short to mask literally: "1" is everywhere
    monkeypatch.setenv("HTTPS_PROXY", "http://bob:proxypass99@proxy:3128")
    out = redact_text("key abcdef123456 step 1 of 10, proxypass99 alone")
    assert "abcdef123456" not in out
    assert "proxypass99" not in out
    assert "step 1 of 10" in out
    assert "abcdef123456" in secret_env_values()
    assert "1" not in secret_env_values()


def test_extra_secrets_are_masked() -> None:
    assert redact_text("id=qwertyuiop", secrets=["qwertyuiop"]) == f"id={MASK}"


def test_home_and_user_only_on_request() -> None:
    text = "/home/alice/venv/bin/python /tmp/torchinductor_alice /home/alicex alice"
    assert redact_text(text) == text
    out = redact_text(text, home="/home/alice", user="alice")
    assert out == "~/venv/bin/python /tmp/torchinductor_<user> /home/alicex <user>"


def test_host_name_is_masked_in_host_fields_and_long_names_in_text() -> None:
    """--redact-paths also hides the machine: every host field, and the name (or its short form)
    in text when it is long enough not to hit ordinary words; a longer name is left alone."""
    redactor = make_redactor(host="gpu-node-17.corp.example")
    text = "ran on gpu-node-17 (gpu-node-17.corp.example), not on gpu-node-170"
    assert redactor.text(text) == "ran on <host> (<host>), not on gpu-node-170"
    trace = {"host_name": "gpu-node-17", "args": {"hostname": "x"}, "other": "kept"}
    assert redactor.obj(trace) == {
        "host_name": "<host>",
        "args": {"hostname": "<host>"},
        "other": "kept",
    }
    short = make_redactor(host="vm")
    assert short.text("vm.max_map_count on vm") == "vm.max_map_count on vm"
    assert short.obj({"host_name": "vm"}) == {"host_name": "<host>"}
    assert make_redactor().obj({"host_name": "vm"}) == {"host_name": "vm"}  # only on request


def test_redact_obj_walks_structures_and_drops_secret_keys() -> None:
    data: dict[str, Any] = {
        "env": {"HF_TOKEN": HF, "OMP_NUM_THREADS": "8"},
        "printed": [f"token is {HF}", ("tuple", 1)],
        f"note {HF}": 1.5,
        "n": None,
        "ok": True,
    }
    out = redact_obj(data)
    assert out["env"] == {"OMP_NUM_THREADS": "8"}
    assert out["printed"] == [f"token is hf_{MASK}", ["tuple", 1]]
    assert out[f"note hf_{MASK}"] == 1.5
    assert out["n"] is None and out["ok"] is True
    assert data["env"]["HF_TOKEN"] == HF  # the input is not modified


def test_redactor_is_reusable() -> None:
    redactor = Redactor(secrets=["s3cr3t-value"])
    assert redactor.text("a s3cr3t-value b") == f"a {MASK} b"
    assert redactor.obj({"x": ["s3cr3t-value"]}) == {"x": [MASK]}


def test_redact_record_reaches_every_string_and_keeps_the_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-0123456789")
    record = RunRecord(
        command=f"diagnose run --data /data/{HF}",
        config={"data_dir": f"/data/{HF}", "nested": [{"url": "https://u:pw123456@h/x"}]},
        notes=["logged in with wandb-secret-0123456789"],
        probes=[
            ProbeResult(name="p", status="error", reason=f"401 for {HF}", traceback=f"  {HF}\n")
        ],
        findings=[
            Finding(
                id="x.y",
                title=f"token {HF}",
                evidence={"num_keys": 3, "auth": {"user": "a"}, "shapes": [[1, 2]]},
                fix="--token abcdef123456",
            )
        ],
        trace_path=f"{HF}/trace.json.gz",
    )
    record.timing.samples = [StepSample(index=0, seconds=1.25)]
    redacted = redact_record(record, redact_paths=False)
    text = redacted.to_json()
    for secret in (HF, "wandb-secret-0123456789", "pw123456", "abcdef123456"):
        assert secret not in text
    assert redacted.config["data_dir"] == f"/data/hf_{MASK}"
    assert redacted.config["nested"] == [{"url": f"https://{MASK}@h/x"}]
    assert redacted.probes[0].traceback == f"  hf_{MASK}\n"
    # A secret-named key keeps its place with the value masked (dropping it would silently
    # lose evidence such as "num_keys"); numbers and lists of numbers are untouched.
    assert redacted.findings[0].evidence == {"num_keys": MASK, "auth": MASK, "shapes": [[1, 2]]}
    assert redacted.timing.samples[0].seconds == 1.25
    assert redacted.findings[0].fix == f"--token {MASK}"
    assert record.command.endswith(HF)  # the input is left alone
    assert RunRecord.from_dict(redacted.to_dict()).trace_path == f"hf_{MASK}/trace.json.gz"
