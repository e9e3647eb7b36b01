"""What a secret looks like: the names that hold one, the shapes of tokens, credentials in URLs,
secret options and assignments in text (:func:`mask_shapes`), and secret options in a command line
given as a list (:func:`is_secret_switch`).

:mod:`diagnose.redact` applies these rules to everything diagnose writes or prints; they live here
so that the rules (what is a secret) and their application (where it is masked) each stay whole.

Every pattern runs in time linear in the size of its input, whatever the input: kernel and op names
in profiler traces are arbitrary text (a 90 KB ``'.-a' * 30000`` name once took a trace analysis
from 4 to 98 seconds). Every pattern is written so that a failed match attempt costs no more than
the characters it is anchored to (a run of name characters, a literal), and no position is
re-scanned from each of its predecessors: matches start only at the beginning of such a run, and
the position inside the run is chosen once, in an atomic group. ``benchmarks/bench_redact.py``
times adversarial inputs from 1 KB to 100 MB and fails when the time per MB grows.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping

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
#: :func:`masks_pair`); as an option (``--pass x``), an assignment (``pass=x``, ``PASS=x``, a URL
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


#: Names that hold no secret as a data key ("key": "cached_latents") but do as an option: a
#: trainer's ``--key VALUE`` is a credential more often than not.
_SECRET_AS_OPTION: frozenset[str] = frozenset({"KEY", "KEYS"})


@functools.lru_cache(maxsize=4096)
def is_secret_option(name: str) -> bool:
    """Whether an option ``--name`` (dashes left off) takes a secret value: a secret name
    (:func:`is_secret_name`, so ``--hub_token``, ``--wandb_key``, ``--Password``, ``--oauth2``),
    or a bare ``--key``."""
    return is_secret_name(name) or name.strip().upper() in _SECRET_AS_OPTION


def _is_ambiguous_name(name: str) -> bool:
    """Whether ``name`` is a bare word such as ``pass`` (not in capitals): see
    :data:`_AMBIGUOUS_NAMES`."""
    bare = name.strip()
    return bare.upper() in _AMBIGUOUS_NAMES and not bare.isupper()


def masks_pair(name: str, value: object) -> bool:
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
TokenShape = tuple[tuple[str, ...], re.Pattern[str], str]


def _prefixed(prefix: str, body: str) -> TokenShape:
    """The shape of a token that starts with the literal ``prefix`` (not after a letter or
    digit) and goes on with ``body``; masked after its prefix."""
    literal = re.escape(prefix)
    pattern = re.compile(f"{literal}(?<![A-Za-z0-9]{literal}){body}")
    return (prefix,), pattern, prefix + MASK


_TOKEN_PATTERNS: tuple[TokenShape, ...] = (
    _prefixed("hf_", r"[A-Za-z0-9]{20,}+"),
    (("sk-",), re.compile(r"sk-(?<![A-Za-z0-9_-]sk-)[A-Za-z0-9_-]{20,}+"), "sk-" + MASK),
    _prefixed("github_pat_", r"[A-Za-z0-9_]{20,}+"),
    (("gh",), re.compile(r"(gh(?<![A-Za-z0-9]gh)[pousr]_)[A-Za-z0-9]{20,}+"), r"\1" + MASK),
    _prefixed("glpat-", r"[A-Za-z0-9_-]{20,}+"),
    (("xox",), re.compile(r"(xox(?<![A-Za-z0-9]xox)[abprs]-)[A-Za-z0-9-]{10,}+"), r"\1" + MASK),
    (
        ("AKIA", "ASIA"),
        re.compile(r"(A(?<![A-Z0-9]A)(?:KIA|SIA))[A-Z0-9]{16}(?![A-Z0-9])"),
        r"\1" + MASK,
    ),
    _prefixed("AIza", r"[0-9A-Za-z_-]{35}"),
    # Stripe secret and restricted keys, npm, PyPI upload tokens, Slack app tokens, Google OAuth
    # access tokens, GitLab runner/deploy tokens, DigitalOcean, Databricks, SendGrid, Hugging Face
    # organisation tokens.
    (
        ("_live_", "_test_"),
        re.compile(r"([sr]k(?<![A-Za-z0-9][sr]k)_(?:live|test)_)[A-Za-z0-9]{16,}+"),
        r"\1" + MASK,
    ),
    _prefixed("npm_", r"[A-Za-z0-9]{36}+"),
    _prefixed("pypi-", r"AgE[A-Za-z0-9_-]{20,}+"),
    _prefixed("xapp-", r"[A-Za-z0-9-]{10,}+"),
    _prefixed("ya29.", r"[A-Za-z0-9_-]{20,}+"),
    (
        ("glrt-", "gldt-", "glptt-"),
        re.compile(r"(gl(?<![A-Za-z0-9]gl)(?:rt|dt|ptt)-)[A-Za-z0-9_-]{20,}+"),
        r"\1" + MASK,
    ),
    (("_v1_",), re.compile(r"(do(?<![A-Za-z0-9]do)[por]_v1_)[a-f0-9]{64}"), r"\1" + MASK),
    _prefixed("dapi", r"[a-f0-9]{32}(?![a-f0-9])"),
    _prefixed("SG.", r"[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43}"),
    _prefixed("api_org_", r"[A-Za-z0-9]{20,}+"),
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


def _value(unquoted: str) -> str:
    """A group matching the value of an option or assignment: quoted (spaces and all, to the
    closing quote on the same line), or else an optional quote and a run of ``unquoted``
    characters. A quoted form scans only to the next quote, so no stretch is scanned twice."""
    return "('[^'\\n]*+'|\"[^\"\\n]*+\"|['\"]?+" + unquoted + "++)"


#: ``--token X``, ``--token=X``, ``-api-key X``: the separator may be a space. An option starts at
#: a dash not after a letter, digit, "_" or "-", which may be inside a run of name characters
#: (``x.--token``); as for URLs, the match starts at the run, which must end in a separator (one
#: lookahead), and the atomic group picks the first dash that starts an option. Groups: text
#: before the option (kept), dashes, name, separator, value (with its quotes).
_FLAG = re.compile(
    r"(?<![A-Za-z0-9_.-])(?=[A-Za-z0-9_.-]*+[= \t])"
    r"(?>([A-Za-z0-9_.-]*?)(?<![A-Za-z0-9_-])(--?)(" + _NAME + r"))"
    r"(=|[ \t]++)" + _value(r"[^\s'\"]")
)
#: ``token=X``, ``token: X``, ``"token": "X"``, ``token='X'`` (URL queries, reprs, JSON, YAML).
#: Starts only at the beginning of a run of name characters (the lookbehind), so it is linear.
_ASSIGN = re.compile(
    r"(?<![A-Za-z0-9_.-])("
    + _NAME
    + r")(['\"]?)(\s*+(?:=|:(?!//))\s*+)"
    + _value(r"[^\s'\"&,;}\])]")
)


_AUTH_SCHEMES = frozenset({"bearer", "basic", "digest"})


def _quote_of(value: str) -> str:
    """The quote a matched value is wrapped in ("" when none, or only an opening one)."""
    if len(value) >= 2 and value[0] in "'\"" and value[-1] == value[0]:
        return value[0]
    return value[0] if value[:1] in ("'", '"') else ""


def _bare(value: str) -> str:
    return value.strip("'\"")


def _mask_flag(match: re.Match[str]) -> str:
    before, dashes, name, sep, value = match.groups()
    bare = _bare(value)
    if not is_secret_option(name) or value.startswith("-") or bare == MASK or not bare:
        return match.group(0)
    quote = _quote_of(value)
    return f"{before}{dashes}{name}{sep}{quote}{MASK}{quote if len(value) > 1 else ''}"


def _mask_assignment(match: re.Match[str]) -> str:
    name, close_quote, sep, value = match.groups()
    bare = _bare(value)
    if "=" not in sep and not masks_pair(name, bare):
        # "the backward pass: DistributedDataParallel(...)": a bare "pass" before a colon is
        # prose or a data key unless its value looks like a credential; "pass=x" is not prose.
        return match.group(0)
    if not is_secret_name(name) or bare == MASK or not bare or bare.lower() in _AUTH_SCHEMES:
        # "Authorization: Bearer ***": the scheme word is not the secret, the token after it is
        # (masked by the Bearer/Basic pattern).
        return match.group(0)
    quote = _quote_of(value)
    closing = quote if len(value) >= 2 and value[-1] == quote else ""
    return f"{name}{close_quote}{sep}{quote}{MASK}{closing}"


#: One command-line element that is an option alone, without ``=VALUE``: ``--hub_token``.
_OPTION_ALONE = re.compile(r"--?+(" + _NAME + r")")


def is_secret_switch(element: str) -> bool:
    """Whether a command-line element is a secret option whose value is the next element."""
    if len(element) > 200 or not element.startswith("-"):
        return False
    match = _OPTION_ALONE.fullmatch(element)
    return match is not None and is_secret_option(match.group(1))


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


def mask_shapes(text: str) -> str:
    """``text`` with every secret recognisable by its shape or its name masked: private keys,
    token shapes, credentials in URLs, secret options (``--token X``) and assignments
    (``password: X``)."""
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
    return text


__all__ = [
    "HOST_KEYS",
    "HOST_MASK",
    "MASK",
    "MIN_HOST_LENGTH",
    "MIN_SECRET_LENGTH",
    "is_secret_name",
    "is_secret_option",
    "is_secret_switch",
    "mask_shapes",
    "masks_pair",
    "secret_env_values",
]
