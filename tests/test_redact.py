"""Redaction: records and reports are attached to public tickets."""

from __future__ import annotations

import time
from typing import Any

import pytest

from diagnose.record import Finding, ProbeResult, RunRecord, StepSample
from diagnose.record_io import record_from_dict
from diagnose.redact import (
    MASK,
    Redactor,
    is_secret_name,
    make_redactor,
    redact_command,
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
        "GPG_PASSPHRASE",
        "pass",  # as an option or variable name; see the "pass" tests below for prose and data
        "PASS",
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
    assert record_from_dict(redacted.to_dict()).trace_path == f"hf_{MASK}/trace.json.gz"


# --- linear time on adversarial text -------------------------------------------------------------

#: Texts built to defeat one pattern each (a run of name characters where an option, a URL scheme
#: or a JSON web token could start at every step; a BEGIN line with no END; ...). Quadratic
#: backtracking takes minutes on 1 MB of any of them; linear redaction well under a second.
ADVERSARIAL_UNITS = {
    "kernel name": ".-a",  # the ticket's '.-a' * 30000
    "double dashes": ".--a",
    "dashes": "-",
    "assignments": "a=",
    "spaced assignments": "a = ",
    "colons": "a:",
    "scheme characters": "a+",
    "empty schemes": "x://",
    "jwt starts": "-eyJ",
    "options without values": "--token ",
    "bearer words": "bearer ",
    "one long line": "x.y-z_w/Q9:",
    "short lines": "a\n--t=1\nk: v\n",
    "open quotes": "--lr '",
    "assignment quotes": "a='",
    "json quotes": '"k": "',
    "key shape hints": "npm_ sk_live_ ya29. SG. dapi do_v1_ glrt- pypi-AgE xapp- api_org_ ",
}
ADVERSARIAL_PREFIXED = {"url without @": ("http://", "a"), "jwt dots": ("eyJ", "a.")}
ONE_MB = 1_000_000
#: Generous: linear redaction takes 0.05-0.6 s (CPU) per MB on a busy machine; quadratic, minutes.
LINEAR_BOUND_S = 5.0
#: Sizes tried in turn, each against the bound scaled to its size (at least 0.5 s): a quadratic
#: regression fails on a small size in seconds instead of running for hours on the megabyte.
SIZES = (32_000, 256_000, ONE_MB)


def _bound(size: int) -> float:
    return max(0.5, LINEAR_BOUND_S * size / ONE_MB)


PLANTED = (
    f"login {HF}\n--token s3cr3tvalue\nhttps://bob:pw123456@host/x\npassword: hunter2hunter2\n"
)


def _adversarial(name: str, size: int) -> str:
    if name in ADVERSARIAL_UNITS:
        unit = ADVERSARIAL_UNITS[name]
        return unit * (size // len(unit))
    prefix, unit = ADVERSARIAL_PREFIXED[name]
    return prefix + unit * (size // len(unit))


def _timed_text(redactor: Redactor, text: str) -> tuple[str, float]:
    start = time.process_time()  # CPU time: other work on the machine does not count
    out = redactor.text(text)
    return out, time.process_time() - start


@pytest.mark.parametrize("name", [*ADVERSARIAL_UNITS, *ADVERSARIAL_PREFIXED])
def test_adversarial_megabyte_redacts_in_linear_time_and_masks_stay_right(name: str) -> None:
    redactor = Redactor(home="/home/alice", user="alice", host="gpu-node-17")
    for size in SIZES:
        filler = _adversarial(name, size)
        out, seconds = _timed_text(redactor, f"{PLANTED}\n{filler}\n{PLANTED}")
        assert seconds < _bound(size), f"{name}: {seconds:.1f} s for {size} B (quadratic?)"
        for secret in (HF, "s3cr3tvalue", "pw123456", "hunter2hunter2"):
            assert secret not in out
        assert out.count(f"hf_{MASK}") == 2 and out.count(f"--token {MASK}") == 2
        assert out.count(f"https://{MASK}@host/x") == 2
        assert out.count(f"password: {MASK}") == 2
        assert f"\n{filler}\n" in out  # nothing in the filler is a secret


def test_private_key_begin_lines_without_end_are_linear_and_left_alone() -> None:
    """A lazy BEGIN.*?END scans to the end of the text from every BEGIN line that has no END."""
    key = "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA\n-----END RSA PRIVATE KEY-----"
    for size in SIZES:
        begins = "-----BEGIN RSA PRIVATE KEY-----\n" * (size // 32)
        out, seconds = _timed_text(Redactor(), f"{key}\n{begins}")
        assert seconds < _bound(size), f"{seconds:.1f} s for {size} B (quadratic?)"
        assert out == f"-----BEGIN PRIVATE KEY----- *** -----END PRIVATE KEY-----\n{begins}"
    # Every BEGIN up to the first END after it is one block, as before.
    assert redact_text(f"{begins}{key} tail") == (
        "-----BEGIN PRIVATE KEY----- *** -----END PRIVATE KEY----- tail"
    )


def test_tokens_inside_long_runs_are_still_masked() -> None:
    """The linear rewrites start a match at the run of characters the token sits in and pick the
    first place in it where the token can start: the same matches as trying every place."""
    jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpMeJf36POk6y"
    assert redact_text("a-" * 5000 + jwt) == "a-" * 5000 + "eyJ" + MASK
    assert redact_text("x_eyJ-eyJ" + jwt[3:]) == "x_eyJ" + MASK
    assert redact_text(".-a" * 5000 + "+git+https://tok@github.com/x") == (
        ".-a" * 5000 + f"+git+https://{MASK}@github.com/x"
    )
    assert redact_text("_http://u:p@h") == "_http://u:p@h"  # no word boundary: not a URL
    assert redact_text("a.b" * 5000 + ".--api-key=s3cr3tvalue") == (
        "a.b" * 5000 + f".--api-key={MASK}"
    )
    assert redact_text("x.-a.--token s3cr3tvalue") == f"x.-a.--token {MASK}"  # "-a.--token"
    assert redact_text("a-b--token s3cr3tvalue") == "a-b--token s3cr3tvalue"  # not an option
    assert redact_text("xBearer abcdefghijklmnop") == "xBearer abcdefghijklmnop"
    assert redact_text("BEARER abcdefghijklmnop") == f"BEARER {MASK}"
    assert redact_text("XAKIAIOSFODNN7EXAMPLE AKIAIOSFODNN7EXAMPLE") == (
        f"XAKIAIOSFODNN7EXAMPLE AKIA{MASK}"
    )
    assert redact_text("xhf_" + HF[3:]) == "xhf_" + HF[3:]


# --- "pass": a secret word that is also a word of prose and data ---------------------------------

PROSE = (
    "overlap the gradient all-reduce with the backward pass: "
    "DistributedDataParallel(model, bucket_cap_mb=25) does it"
)


@pytest.mark.parametrize(
    "text",
    [
        PROSE,
        "the forward pass: it fuses the two matmuls.",
        "Pass: Forward",
        'rows [{"op": "aten::mm", "pass": "backward", "calls_per_step": 2}]',
        "{'pass': 'forward'}",
        "the first pass: torch.compile(model) then",
    ],
)
def test_pass_in_prose_and_data_is_not_a_secret(text: str) -> None:
    assert redact_text(text) == text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("password: hunter2", f"password: {MASK}"),
        ("--password x", f"--password {MASK}"),
        ("--pass hunter", f"--pass {MASK}"),  # an option named pass holds a password
        ("DB_PASS=x", f"DB_PASS={MASK}"),
        ("db_pass: hunter", f"db_pass: {MASK}"),  # pass inside a longer name
        ("dbPass: hunter", f"dbPass: {MASK}"),
        ("PASS=hunter", f"PASS={MASK}"),  # an environment variable
        ("PASS: hunter", f"PASS: {MASK}"),  # capitals: a name, not prose
        ("pass=forward", f"pass={MASK}"),  # an assignment, not prose
        ("https://h/login?user=bob&pass=hunter", f"https://h/login?user=bob&pass={MASK}"),
        ("pass: hunter2", f"pass: {MASK}"),  # a digit: credential-like
        ('{"pass": "s3cr3t!"}', f'{{"pass": "{MASK}"}}'),
        ("pass: pr0xy-Passw0rd-42", f"pass: {MASK}"),
        ("GPG_PASSPHRASE=correct-horse", f"GPG_PASSPHRASE={MASK}"),
    ],
)
def test_real_passwords_stay_masked(text: str, expected: str) -> None:
    assert redact_text(text) == expected


def test_pass_evidence_key_is_kept_and_credential_like_values_are_masked() -> None:
    rows = [{"op": "aten::mm", "pass": "forward"}, {"op": "aten::mm", "pass": "backward"}]
    assert redact_obj(rows) == rows
    assert make_redactor().obj(rows, mask_secret_keys=True) == rows
    # Planted faults: the same key holding a credential, in capitals, inside a longer name.
    assert redact_obj({"pass": "hunter2", "x": 1}) == {"x": 1}
    masked = make_redactor().obj(
        {"pass": "hunter2", "PASS": "hunter", "db_pass": "hunter", "pass ": 3},
        mask_secret_keys=True,
    )
    assert masked == {"pass": MASK, "PASS": MASK, "db_pass": MASK, "pass ": MASK}


def test_pass_evidence_in_a_record_is_kept() -> None:
    record = RunRecord(
        command="diagnose trace",
        findings=[
            Finding(
                id="precision.fp32_matmul",
                title="fp32 matmuls",
                evidence={
                    "ops": [
                        {"op": "aten::mm", "pass": "backward", "seconds_per_step": 0.25},
                        {"op": "aten::mm", "pass": "forward", "seconds_per_step": 0.125},
                    ],
                    "db_pass": "hunter",
                },
                fix=PROSE,
            )
        ],
    )
    finding = redact_record(record, redact_paths=False).findings[0]
    assert finding.evidence["ops"] == record.findings[0].evidence["ops"]
    assert finding.evidence["db_pass"] == MASK
    assert finding.fix == PROSE


# --- a trainer's command line as an argv list ----------------------------------------------------

#: A command line as trainers take it: secrets as flags of every spelling, a URL with a password,
#: key shapes, and ordinary flags around them (sd-scripts' --max_token_length, a bare --key).
PLANTED_ARGV = [
    "python",
    "train.py",
    "--hub_token",
    "hf_" + "Zz9Yy8Xx7Ww6Vv5Uu4Tt3Ss2Rr1",
    "--password",
    "Sup3rS3cretPw2",
    "--PASSWD",
    "Sup3rS3cretPw5",
    "--db",
    "postgres://admin:Sup3rS3cretPw3@db/x",
    "--aws-key",
    "AKIA" + "ABCDEFGHIJKLMNOP",
    "--wandb_key",
    "0123456789abcdef0123456789abcdef01234567",
    "--client-secret=Sup3rS3cretPw4",
    "--Auth-Header",
    "Sup3rS3cretPw6",
    "--key",
    "Sup3rS3cretPw7",
    "--api_key='Sup3r S3cret Pw8'",
    "--max_token_length",
    "225",
    "--use_auth_token",
    "--output_dir",
    "out",
]
ARGV_SECRETS = (
    "Zz9Yy8Xx7Ww6Vv5Uu4Tt3Ss2Rr1",
    "Sup3rS3cretPw2",
    "Sup3rS3cretPw3",
    "Sup3rS3cretPw4",
    "Sup3rS3cretPw5",
    "Sup3rS3cretPw6",
    "Sup3rS3cretPw7",
    "S3cret",
    "ABCDEFGHIJKLMNOP",
    "0123456789abcdef0123456789abcdef01234567",
)


def test_a_secret_flag_masks_the_next_element_of_an_argv_list() -> None:
    out = redact_obj(PLANTED_ARGV)
    text = "\n".join(out)
    for secret in ARGV_SECRETS:
        assert secret not in text, secret
    assert len(out) == len(PLANTED_ARGV)  # masked in place: the command keeps its shape
    assert out[out.index("--password") + 1] == MASK
    # Ordinary flags keep their values; a boolean secret-named flag does not eat the next flag.
    assert out[out.index("--max_token_length") + 1] == "225"
    assert out[out.index("--use_auth_token") + 1] == "--output_dir"
    assert out[-1] == "out"
    assert PLANTED_ARGV[5] == "Sup3rS3cretPw2"  # the input is not modified


def test_argv_lists_inside_a_record_are_masked_wherever_they_sit() -> None:
    record = RunRecord(
        probes=[
            ProbeResult(
                name="capture",
                data={"command": PLANTED_ARGV, "ranks": {"0": {"argv": PLANTED_ARGV[1:]}}},
            )
        ],
        config={"argv": PLANTED_ARGV},
    )
    text = redact_record(record, redact_paths=False).to_json()
    for secret in ARGV_SECRETS:
        assert secret not in text, secret


def test_the_same_command_as_one_line_is_masked_too() -> None:
    import shlex

    # A line the shell quoted simply reads back whole; one that needed quotes inside quotes
    # ('"'"') is made from the argv instead (redact_command), as diagnose makes its own lines.
    simple = [a for a in PLANTED_ARGV if not a.startswith("--api_key=")]
    for text in (redact_text(shlex.join(simple)), redact_command(PLANTED_ARGV)):
        for secret in ARGV_SECRETS:
            assert secret not in text, secret
        assert "--max_token_length 225" in text
    assert shlex.split(redact_command(PLANTED_ARGV)) == redact_obj(PLANTED_ARGV)


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("--Password=hunter2hunter2", "hunter2hunter2"),
        ("--HUB-TOKEN hunter2hunter2", "hunter2hunter2"),
        ("--my_secret_thing 'two words'", "words"),
        ('--passwd "quoted value"', "value"),
        ("api_key='two words'", "words"),
        ("--oauth2 abcdef", "abcdef"),
        ("--key abcdef", "abcdef"),
        ("mysql://root:hunter2@localhost:3306/db", "hunter2"),
        ("redis://:hunter2@cache:6379", "hunter2"),
        ("sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc", "4eC39HqLyjWDarjtT1zdp7dc"),
        ("npm_" + "abcdefghijklmnopqrstuvwxyz0123456789", "abcdefghijklmnopqrstuvwxyz0123456789"),
        ("pypi-AgEIcHlwaS5vcmc" + "abcdefghijklmnopqrstuvwx", "abcdefghijklmnopqrstuvwx"),
        ("xapp-1-A0123456789-0123456789-abcdef0123", "A0123456789-0123456789-abcdef0123"),
        ("ya29." + "a0AfH6SMBx-abcdefghijklmnop", "a0AfH6SMBx-abcdefghijklmnop"),
    ],
)
def test_more_flag_spellings_urls_and_key_shapes(text: str, secret: str) -> None:
    assert secret not in redact_text(text)
