"""GPTQ: int4 weights chosen for the layer's outputs, not for the weights themselves.

Plain rounding makes each weight as close as it can; GPTQ (Frantar et al., 2022) rounds the
input columns of W [N, K] one at a time and moves the rounding error of each onto the
columns not yet rounded, weighted by how the layer's inputs correlate (H = X'X, from
calibration text through the full-precision model), so the errors cancel in W x. Each block
of columns keeps the scale and zero point of export's least-squares search (quantize.py), so
the format is the same MatMulNBits int4 with zero points; only the codes change.

The same pass gathers the lm_head's inputs (the final norm's output), so the vocabulary
table's 4-bit rows are chosen the same way. What it gains, at no cost in decoding speed:
DESIGN.md, "GPTQ for the int4 codes".
"""
import numpy as np

from .progress import progress
from .quantize import BLOCK, Int4Weight, _pack, quantize_int4

DAMPING = 0.01  # of H's mean diagonal, added to its diagonal: keeps the inverse stable
TOKENS = 16384  # calibration tokens at most (fewer follow a small model less)
# tokens x decoder-layer weights: a small model gets all TOKENS, a larger one fewer, so the
# pass and the Gram matrices cost about the same time whatever the model's size
WORK = 16384 * 110e6
SEQUENCE = 512  # tokens per calibration sequence
CHUNK = 128     # columns rounded between two updates of the rest


def gptq_int4(w: np.ndarray, h: np.ndarray) -> Int4Weight:
    """w [N, K] in int4 ("zp", blocks of BLOCK along K), for inputs whose X'X is h [K, K].

    Columns are rounded in order of their inputs' energy, largest first ("act order"): the
    columns that matter most are rounded while there is most room to correct them. Each
    block's scale and zero point are fitted first, on the float weights, because a block
    of MatMulNBits is contiguous while act order visits its columns in any order."""
    n, k = w.shape
    fit = quantize_int4(w)
    scales = np.ascontiguousarray(fit.scales.T)  # [blocks, N]: a column's are row col // BLOCK
    zeros = np.ascontiguousarray(fit.zeros().T, np.float32)
    order = np.argsort(-np.diag(h), kind="stable")
    u = error_spread(h, order)
    # one row per input column, in rounding order: each update touches contiguous rows
    wt = np.ascontiguousarray(w.T[order], np.float32)
    codes = np.empty((k, n), np.uint8)
    for start in range(0, k, CHUNK):  # errors spread within a chunk at once, beyond it lazily
        end = min(k, start + CHUNK)
        errors = np.empty((end - start, n), np.float32)
        for j, i in enumerate(range(start, end)):
            scale, zero = scales[order[i] // BLOCK], zeros[order[i] // BLOCK]
            q = np.clip(np.rint(wt[i] / scale) + zero, 0, 15)
            codes[i] = q
            errors[j] = (wt[i] - (q - zero) * scale) / u[i, i]
            wt[i + 1:end] -= u[i, i + 1:end, None] * errors[j]
        wt[end:] -= u[start:end, end:].T @ errors
    codes = np.ascontiguousarray(codes[np.argsort(order)].T)  # the inputs' order, [N, K]
    return Int4Weight(_pack(codes.reshape(n, k // BLOCK, BLOCK)), fit.scales,
                      zero_points=fit.zero_points)


def error_spread(h: np.ndarray, order) -> np.ndarray:
    """The upper Cholesky factor U of H^-1 (H^-1 = U'U) with H's inputs in `order` and damped,
    float32: row i says how column i's rounding error spreads onto the columns after it.
    Through torch's Cholesky inverse, faster than inverting, each step's result replacing
    the last (at most two K x K matrices of its own at a time)."""
    import torch
    order = torch.from_numpy(order)
    h = torch.from_numpy(np.asarray(h, np.float64))[order][:, order]
    h.diagonal().add_(DAMPING * h.diagonal().mean() + 1e-8)
    h = torch.linalg.cholesky(h)
    h = torch.cholesky_inverse(h)
    return torch.linalg.cholesky(h, upper=True).float().numpy()


def calibration_tokens(arch) -> int:
    """How many calibration tokens GPTQ runs for a model of this architecture."""
    a = arch
    per_layer = a.hidden_size * (2 * a.num_heads + 2 * a.num_kv_heads) * a.head_dim \
        + 3 * a.hidden_size * a.intermediate_size
    return int(max(SEQUENCE, min(TOKENS, WORK / (per_layer * a.num_layers))))


def calibration_ids(source, prompts, tokens) -> np.ndarray:
    """[sequences, SEQUENCE] token ids, about `tokens` of them: the instructions through the
    chat template, end to end."""
    stream = []
    for prompt in prompts:
        stream += source.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], chat_template=source.chat_template,
            add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(stream) >= tokens:
            break
    count = max(1, min(len(stream), tokens) // SEQUENCE)
    return np.asarray(stream[:count * SEQUENCE], np.int64).reshape(count, SEQUENCE)


def quantize_layers(blocks, source, prompts, log=print):
    """GPTQ every decoder layer's linear weights into `blocks`' cache (Blocks.quantized picks
    them up when the graphs are built), and leave the lm_head's X'X for the table's 4-bit
    rows (Blocks.vocab_parts). One pass of the calibration text through the
    reference model, which holds one layer at a time: each layer's inputs are gathered as it
    runs and its weights quantized right after, so only one layer's X'X is ever held."""
    from .reference import Reference
    ids = calibration_ids(source, prompts, calibration_tokens(blocks.arch))
    reference = Reference(source.arch, source.weights)
    model = reference.model
    hooks, grams = [], {}

    def accumulate(name, x):
        x = x.detach().reshape(-1, x.shape[-1])
        grams[name] = grams.get(name, 0) + (x.T @ x).double().numpy()

    def gather(name):
        return lambda module, args: accumulate(name, args[0])

    def finish(layer):
        def hook(module, args, out):
            for name in blocks.LINEARS:
                blocks.quantized(f"layers.{layer}.{name}", blocks.linear_weight(layer, name), 4,
                                 grams.pop(name))
            bar.update()
        return hook

    # the final norm's output is the lm_head's input: GPTQ for the vocabulary table's 4-bit rows
    hooks.append(model.norm.register_forward_hook(
        lambda module, args, out: accumulate("head", out)))
    for i, layer in enumerate(model.layers):
        for name, modules in blocks.LINEARS.items():  # the first of each reads the inputs
            hooks.append(layer.get_submodule(modules[0]).register_forward_pre_hook(gather(name)))
        hooks.append(layer.register_forward_hook(finish(i)))
    log(f"GPTQ: {ids.size} calibration tokens through the full-precision model")
    try:
        with progress(blocks.arch.num_layers, "GPTQ", unit="layer") as bar:
            reference.hidden(ids.tolist())  # the decoder only: no logits are needed
    finally:
        for hook in hooks:
            hook.remove()
    blocks.head_gram = grams.pop("head")
