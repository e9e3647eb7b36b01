"""The LoRA training workload: real diffusers/transformers/peft models at tiny size, on the CPU."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from diagnose.config import PRESETS, RunConfig
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.timing import PhaseTimer
from diagnose.workload import build_workload
from diagnose.workload.attention import attention_context, available_sdpa_backends
from diagnose.workload.families import latent_image_ids, pack_latents, unpack_latents
from diagnose.workload.model_folder import load_components, save_model_folder
from diagnose.workload.models import build_components, precision_policy
from diagnose.workload.presets import load_preset
from diagnose.workload.step import Workload
from diagnose.workload.synthetic_images import generate_images
from diagnose.workload.tokenizers import HashTokenizer, PretrainedTokenizer

CPU = torch.device("cpu")
ALL_PHASES = {"h2d", "encode", "forward", "backward", "optimizer"}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small real image folder (JPEG + PNG with captions), shared by the module's tests."""
    folder = tmp_path_factory.mktemp("images")
    generate_images(folder, count=3, seed=1, size=(96, 80))
    return str(folder)


def tiny(images: str, preset: str = "sd15", **overrides: object) -> RunConfig:
    settings: dict[str, object] = {
        "preset": preset,
        "size": "tiny",
        "resolution": [64],
        "data_dir": images,
    }
    settings.update(overrides)
    return RunConfig(**settings)  # type: ignore[arg-type]


def run_steps(workload: Workload, count: int) -> tuple[list[float], list[PhaseTimer]]:
    losses: list[float] = []
    timers: list[PhaseTimer] = []
    batches = workload.batches()
    for _ in range(count):
        timer = PhaseTimer(lambda: None)
        losses.append(workload.step(next(batches), timer))
        timers.append(timer)
    return losses, timers


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.fixture
def built(request: pytest.FixtureRequest) -> Iterator[list[Workload]]:
    """Collects workloads a test builds and closes them even when the test fails."""
    workloads: list[Workload] = []
    yield workloads
    for workload in workloads:
        workload.close()


# --------------------------------------------------------------------------------------------
# Every preset trains


@pytest.mark.parametrize("preset", PRESETS)
def test_tiny_preset_trains_only_its_lora(preset: str, images: str, built: list[Workload]) -> None:
    workload = build_workload(tiny(images, preset), CPU)
    built.append(workload)
    denoiser = workload.denoiser
    trainable = {n for n, p in denoiser.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert workload.model_info.trainable_parameters == sum(
        p.numel() for p in denoiser.parameters() if p.requires_grad
    )
    assert workload.model_info.lora_modules > 0
    assert not any(p.requires_grad for e in workload.text_encoders for p in e.parameters())
    assert not any(p.requires_grad for p in workload.vae.parameters())

    before = snapshot(denoiser)
    losses, timers = run_steps(workload, 2)

    assert all(math.isfinite(loss) for loss in losses)
    assert all(set(t.seconds) == ALL_PHASES for t in timers)
    after = snapshot(denoiser)
    changed = {name for name, value in before.items() if not torch.equal(value, after[name])}
    assert changed <= trainable, f"base weights changed: {sorted(changed - trainable)[:5]}"
    # Nearly every LoRA weight moved. A few may not: SD3's last block discards the text stream's
    # attention output, so the LoRA on its text queries gets no gradient, in the real model too.
    assert len(trainable - changed) <= 0.1 * len(trainable), sorted(trainable - changed)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16-mixed", "bf16-full"])
def test_precision_sets_the_dtypes_trainers_use(
    precision: str, images: str, built: list[Workload]
) -> None:
    workload = build_workload(tiny(images, precision=precision), CPU)
    built.append(workload)
    policy = precision_policy(precision)
    base = {p.dtype for p in workload.denoiser.parameters() if not p.requires_grad}
    lora = {p.dtype for p in workload.denoiser.parameters() if p.requires_grad}
    assert base == {policy.weight_dtype}
    assert lora == {torch.bfloat16 if precision == "bf16-full" else torch.float32}
    assert {p.dtype for p in workload.text_encoders[0].parameters()} == {policy.weight_dtype}
    vae_dtype = {p.dtype for p in workload.vae.parameters()}
    # The SD VAE's config says force_upcast: in fp16 it stays fp32, as trainers keep it.
    assert vae_dtype == {torch.float32 if precision == "fp16" else policy.weight_dtype}
    assert workload.scaler.is_enabled() == (precision == "fp16")
    assert torch.get_default_dtype() == torch.float32  # construction context restored

    losses, _ = run_steps(workload, 2)
    assert all(math.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "sd15"])
def test_full_bf16_runs_every_architecture(preset: str, images: str, built: list[Workload]) -> None:
    """No autocast in bf16-full: every input the denoiser gets must already be bf16."""
    workload = build_workload(tiny(images, preset, precision="bf16-full"), CPU)
    built.append(workload)
    assert {p.dtype for p in workload.denoiser.parameters()} == {torch.bfloat16}
    losses, _ = run_steps(workload, 1)
    assert math.isfinite(losses[0])


def test_same_seed_same_model_and_loss(images: str, built: list[Workload]) -> None:
    first = build_workload(tiny(images, seed=3), CPU)
    second = build_workload(tiny(images, seed=3), CPU)
    other = build_workload(tiny(images, seed=4), CPU)
    built.extend([first, second, other])
    weight = "conv_in.weight"
    params = [dict(w.denoiser.named_parameters())[weight] for w in (first, second, other)]
    assert torch.equal(params[0], params[1])
    assert not torch.equal(params[0], params[2])
    assert run_steps(first, 1)[0] == run_steps(second, 1)[0]


# --------------------------------------------------------------------------------------------
# Options


@pytest.mark.parametrize("optimizer", ["adamw8bit", "adafactor"])
def test_other_optimizers_step(optimizer: str, images: str, built: list[Workload]) -> None:
    workload = build_workload(tiny(images, optimizer=optimizer), CPU)
    built.append(workload)
    expected = {"adamw8bit": "AdamW8bit", "adafactor": "Adafactor"}[optimizer]
    assert type(workload.optimizer).__name__ == expected
    lora = [p for p in workload.denoiser.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in lora]
    losses, _ = run_steps(workload, 2)
    assert all(math.isfinite(loss) for loss in losses)
    assert any(not torch.equal(b, p) for b, p in zip(before, lora, strict=True))


def test_gradient_checkpointing_gives_the_same_step(images: str, built: list[Workload]) -> None:
    plain = build_workload(tiny(images, "sdxl", precision="fp32"), CPU)
    checkpointed = build_workload(
        tiny(images, "sdxl", precision="fp32", grad_checkpointing=True), CPU
    )
    built.extend([plain, checkpointed])
    assert checkpointed.denoiser.is_gradient_checkpointing  # type: ignore[attr-defined]
    loss_plain = run_steps(plain, 2)[0]
    loss_checkpointed = run_steps(checkpointed, 2)[0]
    # Recomputing activations changes nothing in fp32: same losses, so the LoRA got gradients.
    assert loss_plain == pytest.approx(loss_checkpointed, rel=1e-5)


def test_caching_removes_the_encode_work(images: str, built: list[Workload]) -> None:
    workload = build_workload(
        tiny(images, "zimage", cache_latents=True, cache_text_embeddings=True), CPU
    )
    built.append(workload)
    calls: list[str] = []
    hooks = [
        module.register_forward_hook(lambda *_, name=name: calls.append(name))
        for name, module in [("vae", workload.vae), ("text", workload.text_encoders[0])]
    ]
    try:
        losses, timers = run_steps(workload, 3)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == []
    assert all(set(t.seconds) == ALL_PHASES - {"encode"} for t in timers)
    assert all(math.isfinite(loss) for loss in losses)
    # No image is decoded per step any more: the batches carry no pixels, only the bucket side.
    batch = next(workload.batches())
    assert batch.pixels.numel() == 0
    assert batch.resolution == workload.resolutions[0]


def test_caching_latents_only_still_encodes_captions(images: str, built: list[Workload]) -> None:
    workload = build_workload(tiny(images, "flux", cache_latents=True), CPU)
    built.append(workload)
    vae_calls: list[int] = []
    hook = workload.vae.register_forward_hook(lambda *_: vae_calls.append(1))
    try:
        _, timers = run_steps(workload, 2)
    finally:
        hook.remove()
    assert vae_calls == []
    assert all(set(t.seconds) == ALL_PHASES for t in timers)


def test_custom_and_unmatched_lora_targets(images: str, built: list[Workload]) -> None:
    workload = build_workload(tiny(images, target_modules=["to_q"], rank=4, alpha=8.0), CPU)
    built.append(workload)
    to_q = [n for n, _ in workload.denoiser.named_modules() if n.endswith(".to_q")]
    assert workload.model_info.lora_modules == len(to_q)
    with pytest.raises(DiagnoseError) as caught:
        build_workload(tiny(images, target_modules=["no_such_projection"]), CPU)
    assert caught.value.code == ExitCode.USAGE
    assert "to_q" in caught.value.message  # it lists the names that exist


def test_resolution_the_architecture_cannot_patch_is_refused(images: str) -> None:
    with pytest.raises(DiagnoseError) as caught:
        build_workload(tiny(images, "flux", resolution=[72]), CPU)
    assert caught.value.code == ExitCode.USAGE
    assert "multiple of 16" in caught.value.message


def test_batches_are_endless_and_close_removes_generated_data() -> None:
    workload = build_workload(RunConfig(preset="sd15", size="tiny", resolution=[64]), CPU)
    try:
        root = Path(workload.data_info.root)
        assert workload.data_info.generated and root.is_dir()
        batches = workload.batches()
        count = workload.data_info.images + 2  # more than one epoch
        for _ in range(count):
            batch = next(batches)
            assert tuple(batch.pixels.shape) == (1, 3, 64, 64)
        assert workload.epochs_started >= 2
    finally:
        workload.close()
    assert not root.exists()
    workload.close()  # idempotent


# --------------------------------------------------------------------------------------------
# Attention backends


def _attention_ops(workload: Workload) -> set[str]:
    batch = next(workload.batches())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        workload.step(batch, PhaseTimer(lambda: None))
    return {event.name for event in prof.events() if "attention" in event.name}


def _sdpa_flags() -> tuple[bool, ...]:
    backends: Any = torch.backends.cuda  # untyped functions
    return (
        backends.flash_sdp_enabled(),
        backends.mem_efficient_sdp_enabled(),
        backends.math_sdp_enabled(),
    )


def test_forcing_math_attention_runs_the_math_kernel(images: str, built: list[Workload]) -> None:
    # Everything cached: the only attention in the step is the denoiser's.
    cached: dict[str, object] = {"cache_latents": True, "cache_text_embeddings": True}
    forced = build_workload(tiny(images, "sd15", attention="math", **cached), CPU)
    auto = build_workload(tiny(images, "sd15", **cached), CPU)
    built.extend([forced, auto])
    flags = _sdpa_flags()

    forced_ops = _attention_ops(forced)
    assert "aten::_scaled_dot_product_attention_math" in forced_ops
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in forced_ops
    auto_ops = _attention_ops(auto)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in auto_ops
    assert "aten::_scaled_dot_product_attention_math" not in auto_ops
    # The forced backend is switched back off after the step.
    assert _sdpa_flags() == flags


@pytest.mark.parametrize("name", ["efficient", "cudnn"])
def test_backend_the_cpu_lacks_is_refused_up_front(name: str) -> None:
    with pytest.raises(DiagnoseError) as caught:
        attention_context(name, CPU, head_dims=[40, 80])
    assert caught.value.code == ExitCode.UNSUPPORTED
    assert "this device offers: auto, flash, math" in caught.value.message
    assert "\n" not in caught.value.message
    assert available_sdpa_backends(CPU, [40]) == ["flash", "math"]


def test_xformers_is_refused_without_a_gpu(images: str) -> None:
    with pytest.raises(DiagnoseError) as caught:
        build_workload(tiny(images, attention="xformers"), CPU)
    assert caught.value.code == ExitCode.UNSUPPORTED
    assert "xformers" in caught.value.message


# --------------------------------------------------------------------------------------------
# --model DIR


def _word_level_tokenizer(folder: Path) -> None:
    """A real (tiny) fast tokenizer saved as a model folder's tokenizer/ would be."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<bos>", "<eos>", "a", "photo", "of", "shapes", ",", "number"]
    words += [str(n) for n in range(10)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    fast_class: Any = PreTrainedTokenizerFast  # untyped constructor
    fast = fast_class(
        tokenizer_object=core, pad_token="<eos>", unk_token="<unk>", bos_token="<bos>"
    )
    fast.save_pretrained(folder)


def test_model_folder_round_trip(tmp_path: Path, images: str, built: list[Workload]) -> None:
    components = build_components(load_preset("sd15", "tiny"), CPU, precision_policy("fp32"))
    folder = tmp_path / "model"
    save_model_folder(components, folder)
    _word_level_tokenizer(folder / "tokenizer")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"]

    workload = build_workload(
        RunConfig(model_dir=str(folder), resolution=[64], data_dir=images), CPU
    )
    built.append(workload)
    assert workload.model_info.source == str(folder)
    assert workload.model_info.parameters == components.denoiser_parameters
    tokenizer = workload.components.tokenizers[0]
    assert isinstance(tokenizer, PretrainedTokenizer)
    assert tuple(tokenizer(["a photo of shapes"]).input_ids.shape) == (1, 77)
    original = dict(components.denoiser.named_parameters())["conv_in.weight"]
    loaded = dict(workload.denoiser.named_parameters())["conv_in.weight"]
    assert torch.equal(original.to(torch.bfloat16), loaded)  # bf16-mixed: frozen weights in bf16
    losses, timers = run_steps(workload, 2)
    assert all(math.isfinite(loss) for loss in losses)
    assert set(timers[-1].seconds) == ALL_PHASES


def test_transformer_model_folder_loads_without_tokenizer(tmp_path: Path) -> None:
    components = build_components(load_preset("flux", "tiny"), CPU, precision_policy("fp32"))
    folder = tmp_path / "flux"
    save_model_folder(components, folder)
    loaded = load_components(str(folder), CPU, precision_policy("bf16-mixed"))
    assert loaded.family == "flux"
    assert [type(t) for t in loaded.tokenizers] == [HashTokenizer, HashTokenizer]
    assert next(loaded.denoiser.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        ("missing", "not a folder"),
        ("no_index", "no model_index.json"),
        ("bad_index", "model_index.json is unreadable"),
        ("bad_config", "unet/config.json is unreadable"),
        ("unsupported", "denoiser PixArtTransformer2DModel is not supported"),
        ("no_weights", "cannot load unet"),
    ],
)
def test_unusable_model_folder_is_bad_input(tmp_path: Path, breakage: str, expected: str) -> None:
    folder = tmp_path / "model"
    if breakage != "missing":
        components = build_components(load_preset("sd15", "tiny"), CPU, precision_policy("fp32"))
        save_model_folder(components, folder)
    index_path = folder / "model_index.json"
    if breakage == "no_index":
        index_path.unlink()
    elif breakage == "bad_index":
        index_path.write_text("{not json")
    elif breakage == "bad_config":
        (folder / "unet" / "config.json").write_text('{"in_channels": ')
    elif breakage == "unsupported":
        index = json.loads(index_path.read_text())
        index["unet"] = ["diffusers", "PixArtTransformer2DModel"]
        index_path.write_text(json.dumps(index))
    elif breakage == "no_weights":
        for weights in (folder / "unet").glob("*.safetensors"):
            weights.unlink()
    with pytest.raises(DiagnoseError) as caught:
        load_components(str(folder), CPU, precision_policy("fp32"))
    assert caught.value.code == ExitCode.BAD_INPUT
    assert expected in caught.value.message
    assert "\n" not in caught.value.message


# --------------------------------------------------------------------------------------------
# Pieces


def test_hash_tokenizer_frames_like_the_real_pipelines() -> None:
    clip = HashTokenizer("clip_l", 49408, 77)(["a photo, of a cat", "dog"])
    assert tuple(clip.input_ids.shape) == (2, 77)
    assert clip.input_ids[0, 0] == 49406 and clip.input_ids[0, 7] == 49407  # bos, 6 tokens, eos
    assert (clip.input_ids[1, 3:] == 49407).all()  # padded with eos, as the SD tokenizers pad
    assert clip.attention_mask.sum(dim=1).tolist() == [8, 3]
    t5 = HashTokenizer("t5", 32128, 16)(["a photo of a cat"])
    assert t5.input_ids[0, 5] == 1 and (t5.input_ids[0, 6:] == 0).all()
    assert t5.attention_mask[0].sum() == 6
    qwen = HashTokenizer("qwen3", 151936, 512)(["a cat", "a photo of a cat"])
    assert tuple(qwen.input_ids.shape) == (2, 512)  # padded, as ZImagePipeline encodes it
    assert qwen.attention_mask.sum(dim=1).tolist() == [10, 13]  # chat framing + words


def test_flux_packing_matches_the_pipeline() -> None:
    from diffusers import FluxPipeline

    latents = torch.randn(2, 16, 8, 12)
    packed = pack_latents(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 8, 12))
    assert torch.equal(unpack_latents(packed, 8, 12), latents)
    ids = latent_image_ids(4, 6, CPU, torch.float32)
    assert torch.equal(ids, FluxPipeline._prepare_latent_image_ids(2, 4, 6, CPU, torch.float32))
