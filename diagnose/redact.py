"""Redaction of secrets (and, on request, the user's home folder and name) from text and records.

Records and reports are attached to public bug tickets, so everything the inventory stores and
everything a report prints passes through here first. The rules err on the side of masking: a
masked harmless value costs a reader a little context, a leaked token costs its owner an account.

What is masked (:func:`redact_text`):

- the literal values of every secret-named environment variable currently set (see
  :func:`is_secret_name`), when at least :data:`MIN_SECRET_LENGTH` characters long (so that a
  ``FOO_AUTH=1`` does not turn every "1" into "***"), and passwords found in URLs held by any
  environment variable (``HTTPS_PROXY=http://user:password@proxy:3128``);
- token shapes that are recognisable without context: Hugging Face (``hf_…``), OpenAI/Anthropic
  style (``sk-…``), GitHub (``ghp_…``, ``github_pat_…``), GitLab (``glpat-…``), Slack
  (``xoxb-…``), AWS access key ids (``AKIA…``/``ASIA…``), Google API keys (``AIza…``), JSON web
  tokens, ``Bearer …`` headers and PEM private-key blocks;
- credentials in URLs: ``scheme://user:pass@host`` → ``scheme://***@host``;
- secret-named arguments and assignments: ``--token X``, ``--api-key=X``, ``token=X``,
  ``"password": "X"``;
- optionally the home folder (→ ``~``), the user name (→ ``<user>``) and the machine's host name
  (→ ``<host>``: the value of every ``host_name``/``hostname``/``host`` field, and the name in any
  text when it is at least :data:`MIN_HOST_LENGTH` characters long), for ``--redact-paths``.

Redaction runs in time linear in the size of its input, whatever the input: kernel and op names in
profiler traces are arbitrary text (a 90 KB ``'.-a' * 30000`` name once took a trace analysis from 4
to 98 seconds). Every pattern below is written so that a failed match attempt costs no more than
the characters it is anchored to (a run of name characters, a literal), and no position is
re-scanned from each of its predecessors: matches start only at the beginning of such a run, and
the position inside the run is chosen once, in an atomic group. ``benchmarks/bench_redact.py``
times adversarial inputs from 1 KB to 100 MB and fails when the time per MB grows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from pathlib import Path

    from diagnose.record import RunRecord

#: Secret values shorter than this are not masked literally: "1", "true" or "on" would otherwise
#: be masked everywhere in the text.
MIN_SECRET_LENGTH = 6

MASK = "***"
HOST_MASK = "<host>"
#: Host names shorter than this are masked only in host fields, not in free text ("vm" or "gpu1"
#: would otherwise be replaced inside ordinary words and numbers' labels).
MIN_HOST_LENGTH = 5
#: Field names whose string value is a host name (profiler traces carry ``host_name``).
HOST_KEYS: frozenset[str] = frozenset({"host_name", "hostname", "host"})

#: Parts of a name that mark it as holding a secret. A name is split into words at ``_ - . /``,
#: spaces and camelCase boundaries; a word that *contains* one of these stems marks the name
#: (so ``HFTOKEN``, ``APIKEY`` and ``apiKey`` are caught, not only ``HF_TOKEN``).
_SECRET_STEMS: tuple[str, ...] = (
    "TOKEN",
    "KEY",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "PASSPHRASE",
    "CREDENTIAL",
    "AUTH",
    "COOKIE",
    "SESSION",
)
#: Whole words that mark a name but are too short to be stems (``BYPASS``, ``COMPASS`` are fine).
_SECRET_WORDS: frozenset[str] = frozenset({"PASS", "CREDS", "BEARER"})

#: Secret words that are also ordinary words of prose and data: "the backward pass: ...", an op
#: table's ``"pass": "forward"``. Such a word, written alone as a name in a ``name: value`` pair
#: or as a data key, marks its value as secret only when the value looks like a credential (see
#: :func:`_masks_pair`); as an option (``--pass x``), an assignment (``pass=x``, ``PASS=x``, a URL
#: query's ``&pass=x``), in capitals (``PASS: x``, an environment variable's name) or inside a
#: longer name (``DB_PASS``, ``dbPass``) it is a secret name like any other.
_AMBIGUOUS_NAMES: frozenset[str] = frozenset({"PASS"})

#: Words that contain a stem but are not secrets. Decision: "contains" with this small allow-list
#: rather than exact words, so that unknown spellings (``HFTOKEN``) are still masked.
_HARMLESS_WORDS: frozenset[str] = frozenset(
    {"KEYBOARD", "KEYBOARDS", "KEYMAP", "TOKENIZER", "TOKENIZERS", "AUTHOR", "AUTHORS", "MONKEY"}
)
#: A name whose last word says it holds a size, a mode or an error is not a secret
#: (``MAX_TOKEN_LENGTH``, ``--max_token_length 225`` in sd-scripts, ``AUTH_MODE``, and the
#: ``KeyError: 'gfx'`` that error texts are full of).
_NEUTRAL_LAST_WORDS: frozenset[str] = frozenset(
    {
        "LENGTH",
        "LEN",
        "LIMIT",
        "COUNT",
        "SIZE",
        "MAX",
        "MIN",
        "NUM",
        "TYPE",
        "MODE",
        "PARALLELISM",
        "ERROR",
        "EXCEPTION",
        "WARNING",
    }
)
#: Whole names that match a stem but hold no secret and whose values are common words: masking
#: ``GDMSESSION=ubuntu`` literally would turn the distribution name into "***".
_HARMLESS_NAMES: frozenset[str] = frozenset(
    {
        # A bare "key" names a dict key or a variant ("key": "cached_latents" in probe data), not
        # a credential; API_KEY, SECRET_KEY, ... still count.
        "KEY",
        "KEYS",
        "DESKTOP_SESSION",
        "GDMSESSION",
        "XDG_SESSION_DESKTOP",
        "XDG_SESSION_TYPE",
        "XDG_SESSION_CLASS",
        "XDG_SESSION_ID",
        "XDG_SESSION_PATH",
        "KDE_SESSION_VERSION",
        "KDE_SESSION_UID",
        "SESSION_MANAGER",
        "DBUS_SESSION_BUS_ADDRESS",
        "SSH_AUTH_SOCK",
        "XAUTHORITY",
    }
)

_WORD_SPLIT = re.compile(r"[_\-./\s]+|(?<=[a-z0-9])(?=[A-Z])")


def _name_words(name: str) -> list[str]:
    return [w.upper() for w in _WORD_SPLIT.split(name.strip()) if w]


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a variable, option or key called ``name`` may hold a secret.

    Case-insensitive. ``HF_TOKEN``, ``MY_API_KEY``, ``apiKey``, ``DB_PASSWORD``, ``AUTH``,
    ``SESSION_ID`` are secret; ``KEYBOARD_LAYOUT``, ``TOKENIZERS_PARALLELISM``,
    ``MAX_TOKEN_LENGTH``, ``DESKTOP_SESSION`` are not (see the allow-lists above for why).
    """
    if name.strip().upper() in _HARMLESS_NAMES:
        return False
    words = _name_words(name)
    if not words or words[-1] in _NEUTRAL_LAST_WORDS:
        return False
    for word in words:
        if word in _HARMLESS_WORDS:
            continue
        if word in _SECRET_WORDS or any(stem in word for stem in _SECRET_STEMS):
            return True
    return False


#: A value that reads as a word of prose or as code rather than as a credential: a plain word
#: ("forward", "backward", "it", "DDP") or a call ("DistributedDataParallel(...",
#: "torch.compile(model"). Anything with a digit, a symbol, a space or a second token is not.
_PLAIN_VALUE = re.compile(
    r"[A-Za-z]++[.,;:!?]?+"
    r"|[A-Za-z_][A-Za-z0-9_]*+(?:\.[A-Za-z_][A-Za-z0-9_]*+)*+\(.*",
    re.DOTALL,
)


def _is_ambiguous_name(name: str) -> bool:
    """Whether ``name`` is a bare word such as ``pass`` (not in capitals): see
    :data:`_AMBIGUOUS_NAMES`."""
    bare = name.strip()
    return bare.upper() in _AMBIGUOUS_NAMES and not bare.isupper()


def _masks_pair(name: str, value: object) -> bool:
    """Whether the value of a ``name: value`` pair (in text, or a data key and its value) is
    secret: ``name`` is a secret name and, when it is an ambiguous bare word such as ``pass``,
    ``value`` looks like a credential rather than a plain word or a call."""
    if not is_secret_name(name):
        return False
    if not _is_ambiguous_name(name):
        return True
    return not (isinstance(value, str) and _PLAIN_VALUE.fullmatch(value) is not None)


# --- patterns -------------------------------------------------------------------------------------

#: (hints, pattern, replacement) for token shapes recognisable without context. A pattern runs only
#: when one of its hints (literal text every match contains) is in the text: a cheap pre-filter, as
#: most text holds none of them. The replacement keeps the public prefix so a reader can tell what
#: kind of credential was there. Every repetition is possessive (``{20,}+``: what follows it can
#: never be one of its characters) and every pattern starts only where its token can start, so a
#: failed attempt costs at most the run of characters it started on. Patterns open with their
#: literal and check what precedes it after it (``hf_(?<![A-Za-z0-9]hf_)`` rather than
#: ``(?<![A-Za-z0-9])hf_``: the same matches), so the regex engine can skip to the literal
#: instead of trying every position (20 times faster).
_TOKEN_PATTERNS: tuple[tuple[tuple[str, ...], re.Pattern[str], str], ...] = (
    (("hf_",), re.compile(r"hf_(?<![A-Za-z0-9]hf_)[A-Za-z0-9]{20,}+"), "hf_" + MASK),
    (("sk-",), re.compile(r"sk-(?<![A-Za-z0-9_-]sk-)[A-Za-z0-9_-]{20,}+"), "sk-" + MASK),
    (
        ("github_pat_",),
        re.compile(r"github_pat_(?<![A-Za-z0-9]github_pat_)[A-Za-z0-9_]{20,}+"),
        "github_pat_" + MASK,
    ),
    (("gh",), re.compile(r"(gh(?<![A-Za-z0-9]gh)[pousr]_)[A-Za-z0-9]{20,}+"), r"\1" + MASK),
    (("glpat-",), re.compile(r"glpat-(?<![A-Za-z0-9]glpat-)[A-Za-z0-9_-]{20,}+"), "glpat-" + MASK),
    (("xox",), re.compile(r"(xox(?<![A-Za-z0-9]xox)[abprs]-)[A-Za-z0-9-]{10,}+"), r"\1" + MASK),
    (
        ("AKIA", "ASIA"),
        re.compile(r"(A(?<![A-Z0-9]A)(?:KIA|SIA))[A-Z0-9]{16}(?![A-Z0-9])"),
        r"\1" + MASK,
    ),
    (("AIza",), re.compile(r"AIza(?<![A-Za-z0-9]AIza)[0-9A-Za-z_-]{35}"), "AIza" + MASK),
    # A JSON web token may start anywhere in a run of [A-Za-z0-9_-] not after a letter or digit
    # ("x-eyJ..."). Trying every such start would scan the rest of the run from each (quadratic
    # on "-eyJ" * n); but a start that fails makes every later start in the same run fail too
    # (the segments after it are the same, its first one shorter). So the match starts at the
    # run and an atomic group picks the first "eyJ" in it, once.
    (
        ("eyJ",),
        re.compile(
            r"(?<![A-Za-z0-9_-])(?>([A-Za-z0-9_-]*?)(?<![A-Za-z0-9])eyJ)"
            r"[A-Za-z0-9_-]{8,}+\.[A-Za-z0-9_-]{8,}+\.[A-Za-z0-9_-]{8,}+"
        ),
        r"\1eyJ" + MASK,
    ),
    # "Bearer"/"basic" in any case, after a word boundary (spelled out rather than (?i)\b, which
    # would try every position).
    (
        (),
        re.compile(
            r"([Bb](?<!\w[Bb])(?:[Ee][Aa][Rr][Ee][Rr]|[Aa][Ss][Ii][Cc])\s++)"
            r"[A-Za-z0-9._~+/-]{8,}+=*+"
        ),
        r"\1" + MASK,
    ),
)

#: PEM private-key blocks (:func:`_mask_private_keys`): a lazy ``BEGIN.*?END`` regex scans from
#: every BEGIN to the end of the text when no END follows (quadratic on a text of BEGIN lines).
_PEM_BEGIN = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")
_PEM_END = re.compile(r"-----END [A-Z ]*PRIVATE KEY-----")
_PEM_MASK = "-----BEGIN PRIVATE KEY----- *** -----END PRIVATE KEY-----"


def _mask_private_keys(text: str) -> str:
    """``text`` with every PEM private-key block, BEGIN line to the first END line after it,
    replaced by :data:`_PEM_MASK`. Linear: each stretch of text is searched once, and when no END
    follows a BEGIN none follows any later BEGIN either."""
    if "PRIVATE KEY-----" not in text:
        return text
    parts: list[str] = []
    pos = 0
    while (begin := _PEM_BEGIN.search(text, pos)) is not None:
        end = _PEM_END.search(text, begin.end())
        if end is None:
            break
        parts += (text[pos : begin.start()], _PEM_MASK)
        pos = end.end()
    if not parts:
        return text
    parts.append(text[pos:])
    return "".join(parts)


#: ``scheme://userinfo@`` — the user name alone can be a token (``https://TOKEN@github.com``).
#: The scheme starts at a word boundary inside a run of scheme characters that ends in "://"; the
#: match starts at the run (checked to end in "://" once, by the lookahead), and the atomic group
#: picks the first letter after a word boundary in it, so ``'.-a' * n`` (one run, every "a" after
#: a boundary, no "://") costs one scan instead of one per "a". Group 1 is the text before the
#: scheme, kept.
_URL_USERINFO = re.compile(
    r"(?<![A-Za-z0-9+.-])(?=[A-Za-z0-9+.-]*+://)"
    r"(?>([A-Za-z0-9+.-]*?)\b([A-Za-z][A-Za-z0-9+.-]*+://))[^\s/@'\"<>]++@"
)

#: The name part of an option or assignment whose value is masked when the name is secret.
_NAME = r"[A-Za-z_][A-Za-z0-9_.-]*+"
#: ``--token X``, ``--token=X``, ``-api-key X``: the separator may be a space. An option starts at
#: a dash not after a letter, digit, "_" or "-", which may be inside a run of name characters
#: (``x.--token``); as for URLs, the match starts at the run, which must end in a separator (one
#: lookahead), and the atomic group picks the first dash that starts an option. Groups: text
#: before the option (kept), dashes, name, separator, opening quote, value.
_FLAG = re.compile(
    r"(?<![A-Za-z0-9_.-])(?=[A-Za-z0-9_.-]*+[= \t])"
    r"(?>([A-Za-z0-9_.-]*?)(?<![A-Za-z0-9_-])(--?)(" + _NAME + r"))"
    r"(=|[ \t]++)(['\"]?)([^\s'\"]++)"
)
#: ``token=X``, ``token: X``, ``"token": "X"``, ``token='X'`` (URL queries, reprs, JSON, YAML).
#: Starts only at the beginning of a run of name characters (the lookbehind), so it is linear.
_ASSIGN = re.compile(
    r"(?<![A-Za-z0-9_.-])(" + _NAME + r")(['\"]?)(\s*+(?:=|:(?!//))\s*+)(['\"]?)"
    r"([^\s'\"&,;}\])]++)"
)


_AUTH_SCHEMES = frozenset({"bearer", "basic", "digest"})


def _mask_flag(match: re.Match[str]) -> str:
    before, dashes, name, sep, quote, value = match.groups()
    if not is_secret_name(name) or value.startswith("-") or value == MASK:
        return match.group(0)
    return f"{before}{dashes}{name}{sep}{quote}{MASK}"


def _mask_assignment(match: re.Match[str]) -> str:
    name, close_quote, sep, quote, value = match.groups()
    if "=" not in sep and not _masks_pair(name, value):
        # "the backward pass: DistributedDataParallel(...)": a bare "pass" before a colon is
        # prose or a data key unless its value looks like a credential; "pass=x" is not prose.
        return match.group(0)
    if not is_secret_name(name) or value == MASK or value.lower() in _AUTH_SCHEMES:
        # "Authorization: Bearer ***": the scheme word is not the secret, the token after it is
        # (masked by the Bearer/Basic pattern).
        return match.group(0)
    return f"{name}{close_quote}{sep}{quote}{MASK}"


def _url_passwords(value: str) -> list[str]:
    """Passwords inside URLs in ``value`` (for literal masking wherever else they appear)."""
    found = []
    for match in re.finditer(r"://[^\s/@:'\"]*:([^\s/@'\"]+)@", value):
        found.append(match.group(1))
    return found


def secret_env_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values worth masking literally: secret-named variables and passwords in URL values."""
    env = os.environ if environ is None else environ
    values: set[str] = set()
    for name, value in env.items():
        if is_secret_name(name):
            values.add(value.strip())
        values.update(_url_passwords(value))
    return sorted((v for v in values if len(v) >= MIN_SECRET_LENGTH), key=lambda v: (-len(v), v))


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
        text = _mask_private_keys(text)
        for hints, pattern, replacement in _TOKEN_PATTERNS:
            if not hints or any(hint in text for hint in hints):
                text = pattern.sub(replacement, text)
        if "://" in text:
            text = _URL_USERINFO.sub(r"\1\2" + MASK + "@", text)
        if "-" in text:
            text = _FLAG.sub(_mask_flag, text)
        if "=" in text or ":" in text:
            text = _ASSIGN.sub(_mask_assignment, text)
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
            return [
                v if type(v) in _LEAVES else self.obj(v, mask_secret_keys=mask_secret_keys)
                for v in obj
            ]
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, Mapping):
            out: dict[Any, Any] = {}
            for key, value in obj.items():
                if isinstance(key, str):
                    new_key, secret_name, host_key = self._key(key)
                    secret = secret_name and _masks_pair(key, value)
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
            return [self.obj(v, mask_secret_keys=mask_secret_keys) for v in obj]
        return obj


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
        return [_redact_value(v, redactor) for v in value]
    if isinstance(value, Mapping):
        # A record's mappings hold JSON-like data: the redactor's own walk, keeping secret-named
        # keys (masked) so the record keeps its shape.
        return redactor.obj(value, mask_secret_keys=True)
    return value


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
    "Redactor",
    "is_secret_name",
    "make_redactor",
    "redact_obj",
    "redact_record",
    "redact_text",
    "redact_trace_file",
    "redactor_for",
    "secret_env_values",
]
