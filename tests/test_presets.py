"""Presets: the shipped configs load, are self-consistent, and full sizes match the real models."""

from __future__ import annotations

import pytest

from diagnose.config import PRESETS, SIZES
from diagnose.errors import DiagnoseError, ExitCode
from diagnose.record import ModelInfo
from diagnose.workload.models import count_preset, describe_preset
from diagnose.workload.presets import (
    SDXL_MIN_MEMORY_BYTES,
    all_presets,
    default_preset,
    load_preset,
    preset_counts,
)

GIB = 1024**3

#: Published parameter counts of the real denoisers (diffusers configs instantiated; the model
#: cards round them: SD1.5 UNet 860M, SDXL UNet 2.6B, FLUX.1 12B, SD3-medium 2B, Z-Image 6B).
REAL_DENOISER_PARAMETERS = {
    "sd15": 859_520_964,
    "sdxl": 2_567_463_684,
    "flux": 11_901_408_320,
    "sd3": 2_028_328_000,
    "zimage": 6_154_908_736,
}
#: Text encoders: CLIP ViT-L/14 text 123M, OpenCLIP bigG text 695M, T5 v1.1 XXL encoder 4.76B,
#: Qwen3-4B without its LM head 4.02B.
REAL_TEXT_ENCODERS = {
    "sd15": ["CLIPTextModel (123.1M)"],
    "sdxl": ["CLIPTextModel (123.1M)", "CLIPTextModelWithProjection (694.7M)"],
    "flux": ["CLIPTextModel (123.1M)", "T5EncoderModel (4.76B)"],
    "sd3": [
        "CLIPTextModelWithProjection (123.7M)",
        "CLIPTextModelWithProjection (694.7M)",
        "T5EncoderModel (4.76B)",
    ],
    "zimage": ["Qwen3Model (4.02B)"],
}


def test_every_preset_and_size_loads() -> None:
    assert all_presets() == [(p, s) for p in PRESETS for s in SIZES]
    for name, size in all_presets():
        preset = load_preset(name, size)
        assert preset.family == name
        assert preset.text_encoders and preset.lora_target_modules
        assert preset.latent_channels == (4 if name in ("sd15", "sdxl") else 16)
        if size == "full":
            assert preset.resolutions == ((512,) if name == "sd15" else (1024,))
            for part in ("denoiser", "vae", "text_encoders", "scheduler"):
                assert part in preset.sources, f"{name}/full does not say where {part} is from"
        else:
            assert max(preset.resolutions) <= 128


@pytest.mark.parametrize("size", SIZES)
def test_conditioning_dimensions_agree(size: str) -> None:
    """What the text encoders produce is what each denoiser config expects."""
    sd15 = load_preset("sd15", size)
    assert (
        sd15.denoiser.config["cross_attention_dim"] == sd15.text_encoders[0].config["hidden_size"]
    )

    sdxl = load_preset("sdxl", size)
    clip_l, clip_g = (e.config for e in sdxl.text_encoders)
    unet = sdxl.denoiser.config
    assert unet["cross_attention_dim"] == clip_l["hidden_size"] + clip_g["hidden_size"]
    assert unet["projection_class_embeddings_input_dim"] == (
        clip_g["projection_dim"] + 6 * unet["addition_time_embed_dim"]
    )

    flux = load_preset("flux", size)
    clip, t5 = (e.config for e in flux.text_encoders)
    assert flux.denoiser.config["pooled_projection_dim"] == clip["hidden_size"]
    assert flux.denoiser.config["joint_attention_dim"] == t5["d_model"]
    assert flux.denoiser.config["in_channels"] == 4 * flux.latent_channels
    head = flux.denoiser.config["attention_head_dim"]
    assert sum(flux.denoiser.config["axes_dims_rope"]) == head

    sd3 = load_preset("sd3", size)
    clip_l, clip_g, t5 = (e.config for e in sd3.text_encoders)
    assert sd3.denoiser.config["joint_attention_dim"] == t5["d_model"]
    assert clip_l["hidden_size"] + clip_g["hidden_size"] <= t5["d_model"]
    assert sd3.denoiser.config["pooled_projection_dim"] == (
        clip_l["projection_dim"] + clip_g["projection_dim"]
    )

    zimage = load_preset("zimage", size)
    z = zimage.denoiser.config
    assert z["cap_feat_dim"] == zimage.text_encoders[0].config["hidden_size"]
    assert sum(z["axes_dims"]) == z["dim"] // z["n_heads"]


def test_unknown_preset_or_size_is_a_usage_error() -> None:
    with pytest.raises(DiagnoseError) as caught:
        load_preset("sd2", "full")
    assert caught.value.code == ExitCode.USAGE
    with pytest.raises(DiagnoseError) as caught:
        load_preset("sd15", "huge")
    assert caught.value.code == ExitCode.USAGE


def test_default_preset_follows_the_device() -> None:
    assert default_preset("cpu", None) == ("sd15", "tiny")
    assert default_preset("cpu", 64 * GIB) == ("sd15", "tiny")
    assert default_preset("cuda", 24 * GIB) == ("sdxl", "full")
    assert default_preset("rocm", 24 * GIB) == ("sdxl", "full")
    # A 24 GB card reports a little under 24 GiB; it still gets SDXL.
    assert default_preset("cuda", int(23.6 * GIB)) == ("sdxl", "full")
    assert default_preset("cuda", 16 * GIB) == ("sd15", "full")
    assert default_preset("rocm", SDXL_MIN_MEMORY_BYTES - 1) == ("sd15", "full")
    assert default_preset("cuda", None) == ("sdxl", "full")


def _listed_as_counted(name: str, size: str, info: ModelInfo) -> None:
    """The shipped counts are what the models built now count (else: scripts/preset_counts):
    what `diagnose presets` lists, and what a run's weights' memory is counted from."""
    listed = preset_counts()[(name, size)]
    assert listed == count_preset(name, size), f"{name}/{size}: run scripts/preset_counts"
    assert (listed.class_name, listed.parameters, listed.trainable_parameters) == (
        info.class_name,
        info.parameters,
        info.trainable_parameters,
    )
    # Memory is counted from the shipped file for the preset's own targets at any rank: a LoRA's
    # parameters grow with its rank, which the file's scaling must match.
    assert count_preset(name, size, rank=4) == listed.at_rank(4)
    assert 0 < listed.stored_linear_weights < listed.parameters
    assert all(0 < e.stored_linear_weights < e.parameters for e in listed.text_encoders)


@pytest.mark.parametrize("name", PRESETS)
def test_full_preset_matches_the_real_model_on_meta(name: str) -> None:
    """Built on the meta device: real parameter counts, no memory, seconds at most."""
    info = describe_preset(name, "full")
    _listed_as_counted(name, "full", info)
    real = REAL_DENOISER_PARAMETERS[name]
    assert abs(info.parameters - real) / real < 0.01
    assert info.text_encoders == REAL_TEXT_ENCODERS[name]
    assert info.vae.startswith("AutoencoderKL (83.")
    assert f"{4 if name in ('sd15', 'sdxl') else 16} latent channels" in info.vae
    # The default LoRA (rank 16 on the attention projections) is a small fraction of the model.
    assert info.lora_modules > 50
    assert 0 < info.trainable_parameters < 0.02 * info.parameters
    if name == "sdxl":
        # Rank 16 on to_q/to_k/to_v/to_out.0: 560 modules, 23.2M parameters, the size of a
        # typical SDXL LoRA file (about 45 MB in fp16).
        assert (info.lora_modules, info.trainable_parameters) == (560, 23_224_320)


@pytest.mark.parametrize("name", PRESETS)
def test_tiny_preset_is_tiny(name: str) -> None:
    info = describe_preset(name, "tiny")
    _listed_as_counted(name, "tiny", info)
    assert info.parameters < 5_000_000
    assert info.lora_modules > 0


def test_listing_the_presets_builds_nothing_and_says_nothing_else() -> None:
    """`diagnose presets` in a fresh process: the table on stdout, nothing on stderr, and no
    torch, diffusers or bitsandbytes imported (what made it take seconds and print their
    warnings)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from diagnose.cli import main\n"
        "code = main(['presets'])\n"
        "heavy = sorted({'torch', 'diffusers', 'bitsandbytes', 'peft'} & set(sys.modules))\n"
        "print('imported:', heavy)\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "imported: []"
    assert len(lines) == 2 + len(PRESETS) * len(SIZES)
    assert "859,520,964" in done.stdout  # the full SD1.5 UNet
