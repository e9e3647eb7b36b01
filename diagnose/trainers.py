"""The trainers people run, as this project knows them: their names, how a fix is written in each
one's words, and how a run shows which one it is.

A fix names the setting in every trainer's words (:func:`in_trainers`): the generic form, for a
run whose trainer is not known. When the run shows which trainer it is (:data:`SIGNS`: its
profiler ranges in a trace, a module of its own imported by a profiled process, the name of the
script that process runs), :func:`speak_to` keeps only that trainer's words, so the reader is
told what to change in the code they have. Torch-free: the report and the CI gate import it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diagnose.record import RunRecord

#: The trainers whose vocabulary fixes are written in, in the order a fix lists them.
TRAINERS: dict[str, str] = {
    "kohya": "kohya/sd-scripts",
    "diffusers": "diffusers scripts",
    "onetrainer": "OneTrainer",
    "ai-toolkit": "ai-toolkit",
    "lightning": "Lightning",
    "simpletuner": "SimpleTuner",
}


#: The setting that accumulates gradients over N micro-batches, in each trainer's words.
ACCUMULATION_SETTING: dict[str, str] = {
    "kohya": "--gradient_accumulation_steps {n}",
    "diffusers": "--gradient_accumulation_steps {n}",
    "onetrainer": "gradient_accumulation_steps {n}",
    "ai-toolkit": "gradient_accumulation: {n}",
    "lightning": "Trainer(accumulate_grad_batches={n})",
    "simpletuner": "--gradient_accumulation_steps {n}",
}


def accumulation_setting(trainer: object, micro_batches: int) -> str:
    """``"Trainer(accumulate_grad_batches=4)"`` for a known trainer, else ""."""
    setting = ACCUMULATION_SETTING.get(trainer) if isinstance(trainer, str) else None
    return setting.format(n=micro_batches) if setting else ""


@dataclass(frozen=True)
class TrainerSigns:
    """How a run shows that it is one trainer's."""

    #: Host ranges only that trainer writes into a trace (its own profiler's action names).
    trace_ranges: re.Pattern[str] | None = None
    #: Modules whose import in the training process means the trainer drives it: a package of
    #: its own (``lightning``), or a module of its source tree, which a trainer run from its
    #: checkout imports from the script's folder (``library.train_util``): a dotted name, since
    #: a top-level ``library`` or ``modules`` could be anyone's.
    packages: tuple[str, ...] = ()
    #: The names of its own entry scripts (the profiled process's ``sys.argv[0]``), for a trainer
    #: whose code is all in the script.
    scripts: re.Pattern[str] | None = None
    #: How the report names the ranges it saw in a trace: "its profiler's [Strategy]… ranges".
    ranges_seen_as: str = ""
    #: How the report names a script of its: "one of diffusers' example training scripts".
    script_seen_as: str = ""


#: How each trainer shows, checked in this order. Lightning's profilers name every hook they time
#: ``[LightningModule]Model.training_step``, ``[Strategy]SingleDeviceStrategy.backward``, …;
#: Lightning 2.5+ prefixes them ``[pl][profile]``. kohya's sd-scripts all import
#: ``library.train_util``; OneTrainer's ``scripts/train.py`` its ``modules.trainer``; ai-toolkit's
#: ``run.py`` its ``toolkit.job``; SimpleTuner is the ``simpletuner`` package, or ``helpers`` in an
#: older checkout. diffusers' example scripts import nothing of their own: their names say it.
SIGNS: dict[str, TrainerSigns] = {
    "lightning": TrainerSigns(
        trace_ranges=re.compile(
            r"^\[pl\]\[|\[(?:LightningModule|LightningDataModule|Strategy|Callback)\]"
        ),
        packages=("lightning", "pytorch_lightning"),
        ranges_seen_as="its profiler's [LightningModule]… and [Strategy]… ranges",
    ),
    "kohya": TrainerSigns(packages=("library.train_util",)),
    "onetrainer": TrainerSigns(
        packages=("modules.trainer.GenericTrainer", "modules.trainer.BaseTrainer")
    ),
    "ai-toolkit": TrainerSigns(packages=("toolkit.job", "jobs.process.BaseSDTrainProcess")),
    "simpletuner": TrainerSigns(
        packages=("simpletuner", "helpers.training.state_tracker", "helpers.training.trainer")
    ),
    "diffusers": TrainerSigns(
        scripts=re.compile(
            r"^(?:train_(?:dreambooth|text_to_image|controlnet|instruct_pix2pix|"
            r"custom_diffusion|t2i_adapter|lcm_distill|amused|kandinsky)\w*"
            r"|textual_inversion(?:_sdxl|_flux)?)\.py$"
        ),
        script_seen_as="one of diffusers' example training scripts",
    ),
}


def in_trainers(general: str = "", **per_trainer: str) -> str:
    """A fix in each trainer's words, in a fixed order: ``general`` first, then
    ``kohya/sd-scripts: …; diffusers scripts: …`` for the trainers given (``ai_toolkit`` for
    ai-toolkit)."""
    parts = []
    for key, name in TRAINERS.items():
        text = per_trainer.pop(key.replace("-", "_"), "")
        if text:
            parts.append(f"{name}: {text}")
    if per_trainer:
        raise TypeError(f"unknown trainers: {', '.join(sorted(per_trainer))}")
    trainers = "; ".join(parts)
    if general and trainers:
        return f"{general.rstrip('.')}. {trainers}"
    return general or trainers


_LABEL = re.compile("|".join(re.escape(f"{name}: ") for name in TRAINERS.values()))
#: What may come right before a list of trainers' words: the start, "(" or the end of a
#: sentence (how :func:`in_trainers` and the catalogs place them).
_LIST_OPENERS = ("", "(", ". ", ": ")


def speak_to(fix: str, trainer: str) -> str:
    """``fix`` with each list of trainers' words cut to ``trainer``'s; a list that has nothing in
    its words stays whole (the reader still needs a way). Unknown trainer: ``fix`` unchanged."""
    name = TRAINERS.get(trainer)
    if name is None or not fix:
        return fix
    out: list[str] = []
    position = 0
    for start, end, parts in _trainer_lists(fix):
        out.append(fix[position:start])
        own = [text for label, text in parts if label == name]
        out.append(f"{name}: {own[0]}" if own else fix[start:end])
        position = end
    out.append(fix[position:])
    return "".join(out)


def _trainer_lists(fix: str) -> Iterable[tuple[int, int, list[tuple[str, str]]]]:
    """(start, end, [(trainer name, its words)]) of each ``Name: …; Name: …`` list in ``fix``."""
    position = 0
    while (match := _LABEL.search(fix, position)) is not None:
        start = match.start()
        if not any(fix[:start].endswith(opener) for opener in _LIST_OPENERS if opener) and start:
            position = match.end()
            continue
        parts: list[tuple[str, str]] = []
        cursor = start
        while (label := _LABEL.match(fix, cursor)) is not None:
            text_end = _segment_end(fix, label.end())
            parts.append((label.group(0)[:-2], fix[label.end() : text_end]))
            cursor = text_end
            if fix.startswith("; ", cursor) and _LABEL.match(fix, cursor + 2):
                cursor += 2
                continue
            break
        yield start, cursor, parts
        position = max(cursor, match.end())


def _segment_end(fix: str, start: int) -> int:
    """Where one trainer's words end: before the next ``; Name:``, the ``)`` that closes the
    list's parenthesis, or the end."""
    depth = 0
    index = start
    while index < len(fix):
        char = fix[index]
        if char == "(":
            depth += 1
        elif char == ")":
            if depth == 0:
                return index
            depth -= 1
        elif depth == 0 and fix.startswith("; ", index) and _LABEL.match(fix, index + 2):
            return index
        index += 1
    return index


def trainer_in_trace(range_names: Iterable[str]) -> str | None:
    """The trainer whose own profiler ranges are among ``range_names``, or None."""
    for trainer, signs in SIGNS.items():
        pattern = signs.trace_ranges
        if pattern is not None and any(pattern.search(name) for name in range_names):
            return trainer
    return None


def trainer_in_packages(loaded: Mapping[str, object] | Iterable[str]) -> str | None:
    """The trainer whose package was imported (``sys.modules`` or its keys), or None."""
    names = set(loaded)
    for trainer, signs in SIGNS.items():
        if any(package in names for package in signs.packages):
            return trainer
    return None


def trainer_in_script(script: str) -> str | None:
    """The trainer one of whose own entry scripts ``script`` (a path) is, or None."""
    name = PurePath(script).name
    for trainer, signs in SIGNS.items():
        if signs.scripts is not None and signs.scripts.match(name):
            return trainer
    return None


def watched_modules() -> tuple[str, ...]:
    """Every module whose import names a trainer (what a profiled process reports loaded)."""
    return tuple(dict.fromkeys(p for signs in SIGNS.values() for p in signs.packages))


def speak_to_record(record: RunRecord, trainer: str, seen_as: str) -> None:
    """Write every fix in ``record`` (its findings and each probe's) in ``trainer``'s words,
    record which trainer ran (``config["trainer"]``) and say how it was seen (``seen_as``: "the
    trace holds …"), once."""
    name = TRAINERS.get(trainer)
    if name is None:
        return
    record.config["trainer"] = trainer
    findings = [*record.findings, *(f for p in record.probes for f in p.findings)]
    for finding in findings:
        finding.fix = speak_to(finding.fix, trainer)
    others = [n for key, n in TRAINERS.items() if key != trainer]
    whole = any(f"{n}: " in finding.fix for finding in findings for n in others)
    # A list without this trainer's words stays whole (speak_to): said, not hidden.
    where = " where this project knows them, else in every trainer's" if whole else ""
    note = f"Trainer: {name} ({seen_as}); the fixes are written in its terms{where}."
    if note not in record.notes:
        record.notes.append(note)
