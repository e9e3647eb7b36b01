"""Redaction of secrets (and, on request, the user's home folder and name) from text and records.

Records and reports are attached to public bug tickets, so everything the inventory stores and
everything a report prints passes through here first. The rules err on the side of masking: a
masked harmless value costs a reader a little context, a leaked token costs its owner an account.

What is masked (:func:`redact_text`):

- the literal values of every secret-named environment variable currently set (see
  :func:`is_secret_name`), when at least :data:`MIN_SECRET_LENGTH` characters long (so that a
  ``FOO_AUTH=1`` does not turn every "1" into "***"), and passwords found in URLs held by any
  environment variable (``HTTPS_PROXY=http://user:password@proxy:3128``);
- token shapes that are recognisable without context: Hugging Face (``hf_…``, ``api_org_…``),
  OpenAI/Anthropic style (``sk-…``), GitHub (``ghp_…``, ``github_pat_…``), GitLab (``glpat-…``,
  ``glrt-…``), Slack (``xoxb-…``, ``xapp-…``), AWS access key ids (``AKIA…``/``ASIA…``), Google
  API keys and OAuth tokens (``AIza…``, ``ya29.…``), Stripe, npm, PyPI, DigitalOcean,
  Databricks and SendGrid keys, JSON web tokens, ``Bearer …`` headers and PEM private-key blocks;
- credentials in URLs of any scheme: ``scheme://user:pass@host`` → ``scheme://***@host``;
- secret-named options and assignments, any case, quoted or not: ``--hub_token X``,
  ``--Password 'two words'``, ``--api-key=X``, ``--key X``, ``token=X``, ``"password": "X"``;
  in a command line given as a list (``["--password", "X"]``, as records store argv) the element
  after a secret option is masked whatever it looks like (:meth:`Redactor.items`);
- optionally the home folder (→ ``~``), the user name (→ ``<user>``) and the machine's host name
  (→ ``<host>``: the value of every ``host_name``/``hostname``/``host`` field, and the name in any
  text when it is at least :data:`MIN_HOST_LENGTH` characters long), for ``--redact-paths``.

What a secret looks like (names, shapes, patterns) is :mod:`diagnose.secret_shapes`; every rule
there runs in time linear in the size of its input. This module applies them: to text, to JSON-like
data and command lines given as lists, to records and to the traces diagnose wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from diagnose.secret_shapes import (
    HOST_KEYS,
    HOST_MASK,
    MASK,
    MIN_HOST_LENGTH,
    MIN_SECRET_LENGTH,
    is_secret_name,
    is_secret_option,
    is_secret_switch,
    mask_shapes,
    masks_pair,
    secret_env_values,
)

if TYPE_CHECKING:
    from pathlib import Path

    from diagnose.record import RunRecord

#: Values no redaction changes.
_LEAVES = frozenset({int, float, bool, type(None)})
#: Texts a redactor remembers, and the longest it remembers (memory stays bounded on any input).
_REMEMBERED_TEXTS = 200_000
_REMEMBERED_LENGTH = 1024


@dataclass
class Redactor:
    """Compiled redaction rules; build once, apply to many strings (see :func:`redact_obj`)."""

    secrets: list[str] = field(default_factory=list)
    home: str | None = None
    user: str | None = None
    #: This machine's host name (``--redact-paths``): host fields are masked, and the name in text.
    host: str | None = None
    _literal: re.Pattern[str] | None = field(default=None, init=False, repr=False)
    _host: re.Pattern[str] | None = field(default=None, init=False, repr=False)
    _home: re.Pattern[str] | None = field(default=None, init=False, repr=False)
    _user: re.Pattern[str] | None = field(default=None, init=False, repr=False)
    #: Redacted text by its input: the rules are fixed at construction, and a trace repeats the
    #: same keys and op names hundreds of thousands of times.
    _done: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _keys: dict[str, tuple[str, bool, bool]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        literals = sorted(
            {s for s in self.secrets if len(s) >= MIN_SECRET_LENGTH}, key=lambda s: (-len(s), s)
        )
        if literals:
            # Longest first so that a secret containing another is masked whole.
            self._literal = re.compile("|".join(re.escape(s) for s in literals))
        home = (self.home or "").rstrip("/\\")
        if len(home) > 1:  # never "/" itself
            self._home = re.compile(re.escape(home) + r"(?=$|[/\\\s'\":;,)\]])")
        names = {n for n in (self.host, (self.host or "").split(".")[0]) if n}
        names = {n for n in names if len(n) >= MIN_HOST_LENGTH}
        if names:
            alternatives = "|".join(re.escape(n) for n in sorted(names, key=lambda n: -len(n)))
            self._host = re.compile(r"(?<![A-Za-z0-9-])(?:" + alternatives + r")(?![A-Za-z0-9-])")
        if self.user and len(self.user) >= 2:
            user = re.escape(self.user)
            self._user = re.compile(
                # Not "_" in the guards: "/tmp/torchinductor_alice" names the user too. The name
                # first, then what precedes it (fast: the engine skips to the name).
                user + r"(?<![A-Za-z0-9]" + user + r")(?![A-Za-z0-9])"
            )

    def text(self, text: str) -> str:
        if not text:
            return text
        done = self._done.get(text)
        if done is not None:
            return done
        redacted = self._text(text)
        if len(text) <= _REMEMBERED_LENGTH and len(self._done) < _REMEMBERED_TEXTS:
            self._done[text] = redacted
        return redacted

    def _text(self, text: str) -> str:
        if self._literal is not None:
            text = self._literal.sub(MASK, text)
        text = mask_shapes(text)
        if self._home is not None:
            text = self._home.sub("~", text)
        if self._user is not None:
            text = self._user.sub("<user>", text)
        if self._host is not None:
            text = self._host.sub(HOST_MASK, text)
        return text

    def _key(self, key: str) -> tuple[str, bool, bool]:
        """A data key: (its redacted text, whether it is a secret name, whether it is a host
        field this redactor masks), remembered as texts are."""
        known = self._keys.get(key)
        if known is None:
            known = (
                self.text(key),
                is_secret_name(key),
                bool(self.host) and key.lower() in HOST_KEYS,
            )
            if len(key) <= _REMEMBERED_LENGTH and len(self._keys) < _REMEMBERED_TEXTS:
                self._keys[key] = known
        return known

    def obj(self, obj: Any, *, mask_secret_keys: bool = False) -> Any:
        """A copy of a JSON-like structure with every string (keys too) redacted.

        Entries whose key is a secret name are dropped, or with ``mask_secret_keys`` kept with
        the value replaced by :data:`MASK` (so a record keeps its shape and the reader sees that
        something was hidden).
        """
        kind = type(obj)
        if kind in _LEAVES:  # most of a trace: numbers (checked by type: isinstance is slower)
            return obj
        if kind is str:
            return self.text(obj)
        if kind is list:  # a trace's shape and stride lists: numbers inside, walked inline
            return self.items(obj, mask_secret_keys=mask_secret_keys)
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, Mapping):
            out: dict[Any, Any] = {}
            for key, value in obj.items():
                if isinstance(key, str):
                    new_key, secret_name, host_key = self._key(key)
                    secret = secret_name and masks_pair(key, value)
                else:
                    new_key, secret, host_key = key, False, False
                if secret and not mask_secret_keys:
                    continue
                if secret and value not in (None, "", [], {}):
                    out[new_key] = MASK
                elif host_key and isinstance(value, str) and value:
                    out[new_key] = HOST_MASK
                elif type(value) in _LEAVES:
                    out[new_key] = value
                else:
                    out[new_key] = self.obj(value, mask_secret_keys=mask_secret_keys)
            return out
        if isinstance(obj, (list, tuple)):
            return self.items(obj, mask_secret_keys=mask_secret_keys)
        return obj

    def items(self, values: Iterable[Any], *, mask_secret_keys: bool = False) -> list[Any]:
        """A redacted copy of a list, read as a command line where it holds one: the element
        after a secret option (``["--password", "x"]``, ``["--hub_token", "hf_..."]``) is masked
        whatever it looks like, unless it is itself an option (``--use_auth_token --output_dir
        out``: a switch takes no value)."""
        out: list[Any] = []
        secret_next = False
        for value in values:
            kind = type(value)
            if kind in _LEAVES:
                out.append(value)
                secret_next = False
                continue
            if secret_next and isinstance(value, str) and value and not value.startswith("-"):
                out.append(MASK)
                secret_next = False
                continue
            out.append(self.obj(value, mask_secret_keys=mask_secret_keys))
            secret_next = isinstance(value, str) and is_secret_switch(value)
        return out


def make_redactor(
    *,
    secrets: Iterable[str] = (),
    home: str | None = None,
    user: str | None = None,
    host: str | None = None,
) -> Redactor:
    """A redactor for the current environment's secrets plus ``secrets``."""
    return Redactor(secrets=[*secret_env_values(), *secrets], home=home, user=user, host=host)


def redact_text(
    text: str, *, secrets: Iterable[str] = (), home: str | None = None, user: str | None = None
) -> str:
    """``text`` with secrets masked (see the module docstring for what is masked).

    ``secrets`` are extra literal values to mask, on top of the values of the secret-named
    environment variables set now. ``home`` and ``user`` (for ``--redact-paths``) replace the
    home folder by ``~`` and the user name by ``<user>``.
    """
    return make_redactor(secrets=secrets, home=home, user=user).text(text)


def redact_command(argv: Iterable[str], redactor: Redactor | None = None) -> str:
    """A command line for a record or a terminal line: ``argv`` redacted element by element (a
    secret option masks the element after it), then quoted for a shell. Quoting first would
    wrap a value in shell quotes that text rules cannot always see through."""
    import shlex

    return shlex.join(str(a) for a in (redactor or make_redactor()).items(list(argv)))


def redact_obj(
    obj: Any, *, secrets: Iterable[str] = (), home: str | None = None, user: str | None = None
) -> Any:
    """A copy of a JSON-like structure with every string redacted (keys too).

    Dict entries whose key is a secret name are dropped whatever their value. Tuples become lists
    (as in JSON); other values are kept as they are.
    """
    return make_redactor(secrets=secrets, home=home, user=user).obj(obj)


def redactor_for(redact_paths: bool, *, secrets: Iterable[str] = ()) -> Redactor:
    """The redactor a saved record or report uses: secrets always; with ``redact_paths`` (the
    ``--redact-paths`` option) also the home folder (-> ``~``), the user name (-> ``<user>``)
    and the host name (-> ``<host>``)."""
    if not redact_paths:
        return make_redactor(secrets=secrets)
    user: str | None = None
    with contextlib.suppress(Exception):
        import getpass

        user = getpass.getuser()
    import socket

    return make_redactor(
        secrets=secrets, home=os.path.expanduser("~"), user=user, host=socket.gethostname()
    )


_D = TypeVar("_D")


def redact_dataclass(obj: _D, redactor: Redactor | None = None) -> _D:
    """A copy of dataclass ``obj`` (a record, a sweep) with every string inside it redacted;
    fields keep their names, numbers are untouched. ``redactor``: default, secrets only."""
    return _redact_dataclass(obj, redactor or make_redactor())


def _redact_dataclass(obj: _D, redactor: Redactor) -> _D:
    """A copy of dataclass ``obj`` with every string inside it redacted (fields keep their names:
    a schema field is never dropped, whatever it is called)."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        changes[f.name] = _redact_value(value, redactor)
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]


def _redact_value(value: Any, redactor: Redactor) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _redact_dataclass(value, redactor)
    if isinstance(value, str):
        return redactor.text(value)
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return redactor.items(value)  # a command line, read as one
        return [_redact_value(v, redactor) for v in value]
    if isinstance(value, Mapping):
        # A record's mappings hold JSON-like data: the redactor's own walk, keeping secret-named
        # keys (masked) so the record keeps its shape.
        return redactor.obj(value, mask_secret_keys=True)
    return value


class RedactedStream:
    """A text stream that redacts each line written to it before passing it on: diagnose's own
    terminal output. Lines are redacted whole (``print("--password", x)`` writes its parts one by
    one), so text is held until a line ends (``\\n`` or ``\\r``, a progress line), the stream is
    flushed, or :data:`_HELD_AT_MOST` characters wait. Everything else is the wrapped stream's."""

    def __init__(self, stream: TextIO, redactor: Redactor) -> None:
        self._stream = stream
        self._redactor = redactor
        self._held = ""

    def write(self, text: str) -> int:
        held = self._held + text
        end = max(held.rfind("\n"), held.rfind("\r")) + 1
        if end == 0 and len(held) > _HELD_AT_MOST:
            end = len(held)
        self._held = held[end:]
        if end:
            self._stream.write(self._redactor.text(held[:end]))
        return len(text)

    def flush(self) -> None:
        held, self._held = self._held, ""
        if held:
            self._stream.write(self._redactor.text(held))
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


#: Characters a :class:`RedactedStream` holds back at most while it waits for a line to end.
_HELD_AT_MOST = 1 << 16


@contextlib.contextmanager
def redacted_terminal() -> Iterator[None]:
    """Meanwhile, everything this process prints to ``sys.stdout`` and ``sys.stderr`` is
    redacted (one redactor: the secrets of the environment now). A child process's output, which
    goes to the terminal without passing through this process, is left as it is."""
    import sys

    redactor = make_redactor()
    saved = sys.stdout, sys.stderr
    sys.stdout = RedactedStream(saved[0], redactor)  # type: ignore[assignment]
    sys.stderr = RedactedStream(saved[1], redactor)  # type: ignore[assignment]
    try:
        yield
    finally:
        wrapped = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = saved
        for stream in wrapped:
            with contextlib.suppress(Exception):
                stream.flush()


def redact_trace_file(path: Path, redactor: Redactor) -> None:
    """Rewrite a profiler trace this tool wrote (``.json`` or ``.json.gz``) through ``redactor``:
    the host field Kineto writes, and any string naming the home folder, user or host.

    Only for traces ``diagnose run`` captured itself (small: a few profiled steps); a user's own
    trace is read, never rewritten.
    """
    import gzip

    import orjson

    from diagnose.output import TRACE_GZIP_LEVEL, write_bytes_atomic

    raw = path.read_bytes()
    zipped = raw[:2] == b"\x1f\x8b"
    data = orjson.loads(gzip.decompress(raw) if zipped else raw)
    text = orjson.dumps(redactor.obj(data, mask_secret_keys=True))
    write_bytes_atomic(
        path, gzip.compress(text, compresslevel=TRACE_GZIP_LEVEL, mtime=0) if zipped else text
    )


def redact_record(
    record: RunRecord, *, redact_paths: bool, secrets: Iterable[str] = ()
) -> RunRecord:
    """A copy of ``record`` that is safe to attach to a public ticket.

    Every string anywhere in it (command line, config paths, inventory, probe reasons and
    tracebacks, finding titles, evidence, fixes, notes, trace path) goes through the redactor:
    hub tokens and other token shapes, credentials in URLs, secret-named arguments, the values of
    the secret-named environment variables set now, and ``secrets``. A dict entry whose key is a
    secret name keeps its key with the value masked. With ``redact_paths`` the home folder becomes
    ``~`` and the user name ``<user>``. Numbers are untouched. The input is not modified.
    """
    return _redact_dataclass(record, redactor_for(redact_paths, secrets=secrets))


__all__ = [
    "MASK",
    "MIN_SECRET_LENGTH",
    "RedactedStream",
    "Redactor",
    "is_secret_name",
    "is_secret_option",
    "make_redactor",
    "redact_command",
    "redact_dataclass",
    "redact_obj",
    "redact_record",
    "redact_text",
    "redact_trace_file",
    "redacted_terminal",
    "redactor_for",
    "secret_env_values",
]
