"""What a GPU kernel does, from its name: the class of every kernel of NVIDIA's and AMD's libraries.

A kernel name is read as words: ``routingRenormalize`` is "routing renormalize", ``sm80_xmma_gemm``
is "sm 80 xmma gemm", so a rule for the word "normal" never fires inside "renormalize". The
kernel's own name (what stands before its template arguments and parameters) is read first; only
when it says nothing are its template arguments read (a ``multi_tensor_apply_kernel`` is an
optimizer or a copy by its functor, rocPRIM's ``trampoline_kernel`` by the algorithm in its
arguments). The first rule that matches decides, in the order of :data:`_RULES`: the most
specific vocabulary first (collectives, compiled Triton code, attention, MoE routing), the
catch-all words (copy, add, index) last.

Counted once, overlapping classes (two streams at the same instant) go to the class earliest in
:data:`COUNTED_ONCE_PRECEDENCE`: the math the step exists for first, the copies and the
collectives last, so the time left to communication is its exposed part.
"""

from __future__ import annotations

import re

from diagnose.trace.columns import KERNEL, MEMCPY, MEMSET

#: Every class, in the order tables list them when times tie.
KERNEL_CLASSES: tuple[str, ...] = (
    "gemm",
    "conv",
    "attention_fused",
    "norm",
    "elementwise",
    "reduction",
    "softmax",
    "sort_scan",
    "moe_routing",
    "quantization",
    "optimizer",
    "triton",
    "memcpy",
    "memset",
    "communication",
    "other",
)

#: Which class an instant of device time belongs to when kernels of several classes run at once.
COUNTED_ONCE_PRECEDENCE: tuple[str, ...] = (
    "attention_fused",
    "gemm",
    "conv",
    "triton",
    "moe_routing",
    "quantization",
    "norm",
    "softmax",
    "optimizer",
    "sort_scan",
    "reduction",
    "elementwise",
    "other",
    "memcpy",
    "memset",
    "communication",
)

#: The characters of a name a classifier reads: its own name and its first template arguments
#: (the functor a dispatcher runs, the algorithm of a library kernel) come first, and the longest
#: real names (CUTLASS and Triton kernels) are a few KB. The rest of a longer name is cut: rules are
#: regex searches, and no input should cost more than its start.
MAX_NAME_CHARS = 8192
#: Words of a kernel name: runs of capitals not followed by a lower-case letter ("KV", "HHS"),
#: a word with its first capital ("Cache", "routing"), runs of digits.
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
#: The kernel's own name ends where its template arguments or parameters begin.
_OWN_NAME_END = re.compile(r"[<(]")
#: Kernels that run whatever functor they are given: their arguments say what they do.
_DISPATCHERS = re.compile(
    r" multi tensor apply | native (vectorized |unrolled )?elementwise kernel "
)


def _words(text: str) -> str:
    """ " sm 80 xmma gemm ... ": lower-case words between single spaces, padded with one."""
    return " " + " ".join(_WORD.findall(text)).lower() + " "


def _rule(*alternatives: str) -> re.Pattern[str]:
    """One class's rule: any alternative, matched on the words of a name."""
    return re.compile("|".join(f"(?:{a})" for a in alternatives))


_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "communication",
        _rule(
            r" (nccl|rccl|msccl)",
            r" all ?reduce ",
            r" all ?gather ",
            r" reduce ?scatter ",
            r" all ?to ?all ",
            r" cross device reduce ",
            r" multimem ",
            r" (one|two) shot all reduce ",
            r" deep ep (internode|intranode) ",
        ),
    ),
    # Names torch.compile gives its generated kernels ("triton_poi_fused_...") list the ops
    # fused into them, attention's among others: the prefix decides.
    ("triton", _rule(r"^ triton ")),
    (
        "moe_routing",
        _rule(
            r" routing ",
            r" moe (?!kernel )",  # "fused moe kernel" is the expert GEMM
            r" experts? ",
            r" gating ",
            r" expand input rows ",
            r" bitmatrix ",
            r" finalize (\w+ )*scatter ",
        ),
    ),
    # Copies named after what they copy: layout changes and scaling inside cuDNN/MIOpen (not
    # convolutions), writes into an attention KV cache (not attention).
    (
        "elementwise",
        _rule(
            r" nchw to nhwc ",
            r" nhwc to nchw ",
            r" scale packed tensor ",
            r" batched transpose ",
            r" copy functor ",
            r" reshape and cache ",
        ),
    ),
    (
        "attention_fused",
        _rule(
            r" flash ",
            r" flashattn",
            r" fmha",
            r" attn (fwd|bwd|kernel) ",
            r" attention ",
            r" sdpa ",
            r" mem eff ",
            r" bwd (kernel (dk|dq|fuse)|preprocess) ",
            r" (batch|single) (prefill|decode) ",
            r" merge states? ",
            r" sage ",
            r" qk int \d* sv ",
            r" quant (key|query) ",
        ),
    ),
    (
        "norm",
        _rule(
            r" (layer|batch|group|rms|instance) ?norm",
            r" bn (fw|bw|fwd|bwd)? ",
            r" rowwise moments ",
            r" welford ",
            r" compute internal gradients ",
            r" fused params ",
            r" gamma beta ",
            r" compute grad input ",
        ),
    ),
    (
        "quantization",
        _rule(
            r" (k )?(de)?quant(ize|ization|ized)? ",
            r" fp \d+ (rowwise to float|qparam|quantize)",
            r" (de)?quantize",
        ),
    ),
    (
        "optimizer",
        _rule(
            r" multi tensor apply ",
            r" adam w? ",
            r" adamw ",
            r" sgd ",
            r" lamb ",
            r" adagrad ",
            r" optimizer ",
            r" adafactor ",
            r" lion ",
            r" rmsprop ",
        ),
    ),
    ("softmax", _rule(r" soft ?max")),
    (
        "conv",
        _rule(
            r" conv(?!ert)",
            r"cudnn ",  # at the end of a word ("scudnn"): a search finds it anywhere
            r" (fprop|dgrad|wgrad|igemm|winograd) ",
            r" implicit ?gemm ",
            r" fft \d+ d ",
            r" im \d+ (d \d+ )?col ",
            r" col \d+ im ",
            r" xdlops bwd weight ",
        ),
    ),
    (
        "gemm",
        _rule(
            r"(?<! fb)gemm",  # not the library name fbgemm
            r"gemv",
            r" cijk ",
            r" cublas",
            r" rocblas ",
            r" hipblaslt ",
            r" (add|b)?mm ",
            r" matmul ",
            r" nvjet ",
            r" xmma ",
            r" wmma ",
            r" split ?k ?reduce ",
            r" wv split k",
            r" dot kernel ",
            r" reduce \d+ block kernel ",  # cuBLAS's dot/nrm2 second pass
            r" marlin ",
            r" fused moe kernel ",
        ),
    ),
    (
        "sort_scan",
        _rule(
            r" sort(ed)? ",
            r"searchsorted",
            r" radix ",
            r" scan ",
            r" top ?k ",
            r" sbtopk ",
            r" topk ",
            r" device compact ",
            r" partition ",
        ),
    ),
    (
        "reduction",
        _rule(
            r" reduce ",
            r" reduction ",
            r" pool(ing)? ",
            r" (sum|mean|norm) kernel ",
            r" arg ?(max|min) ",
            r" nll (loss|criterion)",
            r" cross entropy ",
        ),
    ),
    (
        "elementwise",
        _rule(
            r" elementwise ",
            r"functor ",
            r" (copy|fill|index|gather|scatter|transpose|permute|cat|concat|embedding) ",
            r" (dropout|relu|gelu|silu|sigmoid|tanh|clamp|threshold|where|masked) ",
            r" (distribution|philox|random|uniform|normal|upsample|interpolate|pad) ",
            r" (cast|convert|arange|zero|activation|bias|add|mul|flip|roll|triu|tril) ",
            r" tensor op ",
            r" op \d+ d tensor ",
            r" (sub|add|mul) tensor",
            r" kv ?cache ",
            r" amp (non finite|update scale)",  # the AMP grad scaler's unscale and check
            r" store kvcache ",
            r" rotary ",
            r" rope ",
            r" positions? ",
            r" indices ",
            r" vectorized ",
            r" unrolled ",
            r" memcpy ",
            r" memset ",
        ),
    ),
)


def own_name(name: str) -> str:
    """The kernel's own name: no ``void``, no anonymous namespace, no template arguments or
    parameters."""
    text = name[5:] if name.startswith("void ") else name
    text = text.replace("(anonymous namespace)", "")
    end = _OWN_NAME_END.search(text)
    return text[: end.start()] if end else text


def classify_kernel(name: str, kind: int = KERNEL) -> str:
    """The class of one device activity from its name (and kind: kernel, memcpy, memset)."""
    if kind == MEMCPY:
        return "memcpy"
    if kind == MEMSET:
        return "memset"
    name = name[:MAX_NAME_CHARS]
    own = _words(own_name(name))
    whole = _words(name)
    first = whole if _DISPATCHERS.search(own) else own
    for cls, rule in _RULES:
        if rule.search(first):
            return cls
    if first != whole:
        for cls, rule in _RULES:
            if cls != "triton" and rule.search(whole):
                return cls
    return "other"


__all__ = [
    "COUNTED_ONCE_PRECEDENCE",
    "KERNEL_CLASSES",
    "MAX_NAME_CHARS",
    "classify_kernel",
    "own_name",
]
