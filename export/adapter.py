"""The exit adapter: one extra decoder layer on h_E, trained so the draft matches the verifier.

Kangaroo-style self-distillation. `collect` runs the artifact's own greedy generations and
keeps, per position, the exit state h_E and the verifier's top-k next-token distribution.
`train` fits one Llama block (`AdapterLayer`, started from a copy of layer E) so that
head(adapter(h_E)) — the model's own final norm and lm_head, frozen — matches it.
`AdapterLayer` computes the block exactly as export/graph.py builds it, so what is trained
here is what gets exported.
"""
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from .graph import Blocks
from .progress import progress
from .source import Architecture

BATCH = 4             # whole sequences per step: attention needs each row's context
LEARNING_RATE = 4e-4
HELD_OUT = 0.1        # fraction of sequences kept out of training, for the agreement report
CHECKPOINT_EVERY = 60.0  # seconds


@dataclass
class Sequence:
    """One greedy generation, as the training data of the adapter."""
    exit_states: np.ndarray  # [L, hidden] float32: h_E at every position the engine ran
    start: int               # first trained position: the last prompt position
    top_ids: np.ndarray      # [L - start, top_k] int32: verifier's most likely next tokens, best first
    top_probs: np.ndarray    # [L - start, top_k] float32: their probabilities, renormalized
    tokens: np.ndarray       # [L] int64: the token at each position

    @property
    def trained(self) -> int:
        return len(self.top_ids)


# -- collecting the model's own generations --------------------------------------------------

def collect(artifact_dir, prompts, max_new_tokens=128, top_k=32, cache_dir=None, log=print):
    """Greedy plain decoding of each prompt (one user chat turn) with the artifact.

    With cache_dir, each finished sequence is stored there (one .npz per prompt), so a rerun
    or an interrupted run only computes the prompts it lacks."""
    from edgespec.artifact import open_artifact

    art = open_artifact(artifact_dir)
    cache = Path(cache_dir) if cache_dir else None
    if cache:
        cache.mkdir(parents=True, exist_ok=True)
    files = [cache / f"{_sequence_key(art, p, max_new_tokens, top_k)}.npz" if cache else None
             for p in prompts]
    sequences = [_load_sequence(f) if f and f.is_file() else None for f in files]
    todo = [i for i, s in enumerate(sequences) if s is None]
    start = time.perf_counter()
    if todo:
        _generate(art, prompts, todo, sequences, files, max_new_tokens, top_k)
    seconds = time.perf_counter() - start
    new_tokens = sum(sequences[i].trained for i in todo)
    rate = f", {new_tokens / seconds:.0f} tok/s" if todo else ""
    log(f"collect: {len(prompts)} sequences ({len(prompts) - len(todo)} cached, {len(todo)} new), "
        f"{sum(len(s.tokens) for s in sequences)} positions, "
        f"{sum(s.trained for s in sequences)} trained, {seconds:.1f} s{rate}")
    return sequences


def _generate(art, prompts, todo, sequences, files, max_new_tokens, top_k):
    from edgespec.engine import Engine
    from edgespec.tokenizer import TextCodec

    from .calibrate import short_context
    engine = Engine(art, max_context=short_context(art.path))
    seq = engine.new_sequence()
    codec = TextCodec.for_artifact(art)
    eos = set(art.eos_token_ids)
    with progress(len(todo) * max_new_tokens, "collecting generations", unit="tok") as bar:
        for i in todo:
            ids = codec.encode_chat([{"role": "user", "content": prompts[i]}])
            logits, tops = engine.prefill(seq, 0, ids), []
            for generated in range(1, max_new_tokens + 1):
                tops.append(_top(logits, top_k))
                token = int(np.argmax(logits))
                bar.update(1)
                if token in eos or generated == max_new_tokens or \
                        seq.lower_len >= engine.max_context:
                    break
                logits = engine.prefill(seq, seq.lower_len, [token])
            bar.total -= max_new_tokens - generated  # keep the rate honest on early ends
            length = seq.lower_len
            sequences[i] = Sequence(
                exit_states=seq.exit_states.numpy()[0, :length].astype(np.float32),
                start=len(ids) - 1, top_ids=np.stack([t[0] for t in tops]),
                top_probs=np.stack([t[1] for t in tops]),
                tokens=np.array(seq.tokens[:length], np.int64))
            if files[i]:
                _save_sequence(files[i], sequences[i])


def _top(logits, k):
    """The k most likely ids, best first, and their softmax renormalized over those k."""
    x = np.asarray(logits, np.float32)
    ids = np.argpartition(-x, k - 1)[:k]
    ids = ids[np.argsort(-x[ids], kind="stable")]
    p = np.exp(x[ids] - x[ids[0]])
    return ids.astype(np.int32), (p / p.sum()).astype(np.float32)


def _sequence_key(art, prompt, max_new_tokens, top_k):
    """Changes with anything that changes the sequence: every file of the artifact (graphs,
    weights, tokenizer, template), the prompt and the decoding settings."""
    files = {name: info["sha256"] for name, info in art.manifest["files"].items()}
    text = json.dumps([files, prompt, max_new_tokens, top_k], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _save_sequence(path, s):
    partial = path.with_name(path.name + ".partial")  # an interrupted write leaves no .npz
    with open(partial, "wb") as f:
        np.savez(f, exit_states=s.exit_states, start=s.start, top_ids=s.top_ids,
                 top_probs=s.top_probs, tokens=s.tokens)
    os.replace(partial, path)


def _load_sequence(path):
    with np.load(path) as z:
        return Sequence(exit_states=z["exit_states"], start=int(z["start"]), top_ids=z["top_ids"],
                        top_probs=z["top_probs"], tokens=z["tokens"])


# -- the adapter layer -------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """GQA with non-interleaved rotary, causal, scale 1/sqrt(head_dim): GroupQueryAttention."""

    def __init__(self, a: Architecture):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def rotate(x, cos, sin):
    """Rotary, Hugging Face's rotate_half convention (rotary_interleaved=0)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLP(nn.Module):
    def __init__(self, a: Architecture):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AdapterLayer(nn.Module):
    """One Llama decoder layer on the residual stream [batch, seq, hidden]; row i is
    position i. Parameter names are Hugging Face's, less the `model.layers.{i}.` prefix.
    (A sliding window is not applied: training sequences are shorter than any window.)"""

    def __init__(self, arch, weights: dict = None):
        super().__init__()
        self.arch = a = as_architecture(arch)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)
        self.register_buffer("cos", torch.zeros(0), persistent=False)
        self.register_buffer("sin", torch.zeros(0), persistent=False)
        if weights is not None:
            self.load_state_dict({k: torch.tensor(np.asarray(v, np.float32))
                                  for k, v in weights.items()})

    def rotary(self, length):
        """cos, sin [length, head_dim/2]: the export's own tables (export.graph.Blocks)."""
        if len(self.cos) < length:
            tables = Blocks(self.arch, {}, "fp32", max(length, 256)).rotary_tables(np.float32)
            self.cos, self.sin = (torch.from_numpy(t) for t in tables)
        return self.cos[:length], self.sin[:length]

    def forward(self, h):
        cos, sin = self.rotary(h.shape[1])
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))

    def weights(self) -> dict:
        return {k: v.detach().numpy().astype(np.float32).copy()
                for k, v in self.state_dict().items()}


def as_architecture(arch) -> Architecture:
    return arch if isinstance(arch, Architecture) else Architecture(**arch)


def layer_weights(weights: dict, layer: int) -> dict:
    """A copy of layer `layer`'s weights from Hugging Face names, under the adapter's names."""
    prefix = f"model.layers.{layer}."
    return {k[len(prefix):]: v.astype(np.float32).copy() for k, v in weights.items()
            if k.startswith(prefix)}


def head_weights(weights: dict, arch) -> tuple:
    """(final norm weight [H], lm_head table [V, H]) from Hugging Face names, float32."""
    table = "model.embed_tokens.weight" if as_architecture(arch).tie_word_embeddings \
        else "lm_head.weight"
    return weights["model.norm.weight"].astype(np.float32), weights[table].astype(np.float32)


# -- training ------------------------------------------------------------------------------------

class _Head:
    """The model's final norm and lm_head, frozen: draft logits of hidden rows."""

    def __init__(self, arch, norm_weight, table):
        self.eps = as_architecture(arch).rms_norm_eps
        self.norm = torch.as_tensor(np.asarray(norm_weight, np.float32))
        self.table = torch.as_tensor(np.asarray(table, np.float32))

    def __call__(self, rows):
        normed = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
        return normed @ self.table.T


def _batch(sequences):
    """Padded exit states [B, T, H] (padding at the end: causal rows never see it), the flat
    row of each trained position, and its teacher ids and probabilities."""
    length = max(len(s.exit_states) for s in sequences)
    h = torch.zeros(len(sequences), length, sequences[0].exit_states.shape[1])
    rows = []
    for b, s in enumerate(sequences):
        h[b, :len(s.exit_states)] = torch.from_numpy(s.exit_states)
        rows.append(torch.arange(s.start, len(s.exit_states)) + b * length)
    ids = torch.from_numpy(np.concatenate([s.top_ids for s in sequences]).astype(np.int64))
    probs = torch.from_numpy(np.concatenate([s.top_probs for s in sequences]))
    return h, torch.cat(rows), ids, probs


def _loss(layer, head, sequences):
    """Soft cross-entropy of the draft against the teacher's top-k (KL up to a constant),
    mean over trained positions."""
    h, rows, ids, probs = _batch(sequences)
    out = layer(h) if layer is not None else h
    logits = head(out.reshape(-1, h.shape[-1])[rows])
    return (torch.logsumexp(logits, -1) - (probs * logits.gather(1, ids)).sum(-1)).mean()


def distill_loss(sequences, arch, weights, norm_weight, table) -> float:
    """The training loss of `weights` (None: the raw exit, head on h_E) on `sequences`."""
    layer = AdapterLayer(arch, weights) if weights is not None else None
    head = _Head(arch, norm_weight, table)
    with torch.no_grad():
        total = sum(_loss(layer, head, [s]).item() * s.trained for s in sequences)
    return total / sum(s.trained for s in sequences)


def agreement(sequences, arch, weights, norm_weight, table) -> float:
    """Fraction of trained positions where the draft's top token (head on adapter(h_E), or on
    h_E itself when weights is None) is the verifier's."""
    layer = AdapterLayer(arch, weights) if weights is not None else None
    head = _Head(arch, norm_weight, table)
    hits = 0
    with torch.no_grad():
        for s in sequences:
            h = torch.from_numpy(s.exit_states)[None]
            out = (layer(h) if layer is not None else h)[0, s.start:]
            hits += (head(out).argmax(-1).numpy() == s.top_ids[:, 0]).sum()
    return float(hits / sum(s.trained for s in sequences))


def train(sequences, arch, init, norm_weight, table, minutes=8.0, epochs=None, cache_dir=None,
          seed=0, log=print) -> dict:
    """Fit the adapter, from `init` (a copy of layer E's weights), for `minutes` of training
    (summed over resumed runs) or `epochs`, whichever ends first; its trained weights.

    A held-out tenth of the sequences measures top-1 agreement with the verifier. With
    cache_dir, a checkpoint is kept there about once a minute, and a call with the same data,
    init and seed resumes from it."""
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    train_set, held_out = _split(sequences, seed)
    layer = AdapterLayer(arch, init)
    head = _Head(arch, norm_weight, table)
    optimizer = torch.optim.Adam(layer.parameters(), lr=LEARNING_RATE)
    path = Path(cache_dir) / f"adapter-{_training_key(sequences, init, seed)[:16]}.pt" \
        if cache_dir else None
    state = {"step": 0, "seconds": 0.0, "losses": []}
    if path and path.is_file():
        saved = torch.load(path, weights_only=False)
        layer.load_state_dict(saved["layer"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]
        log(f"adapter: resuming from {path} at step {state['step']} "
            f"({state['seconds'] / 60:.1f} min trained)")
    per_epoch = -(-len(train_set) // BATCH)
    last_step = epochs * per_epoch if epochs is not None else None
    budget = minutes * 60.0
    before = state["seconds"]
    start = saved_at = time.perf_counter()
    with progress(last_step, f"training adapter (up to {minutes:.2g} min)", unit="step",
                  initial=state["step"]) as bar:
        while (last_step is None or state["step"] < last_step) and \
                before + time.perf_counter() - start < budget:
            loss = _loss(layer, head, _step_batch(train_set, state["step"], per_epoch, seed))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
            optimizer.step()
            state["step"] += 1
            state["losses"].append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)  # a line each 15 s
            state["seconds"] = before + time.perf_counter() - start
            if path and time.perf_counter() - saved_at > CHECKPOINT_EVERY:
                _save_checkpoint(path, layer, optimizer, state)
                saved_at = time.perf_counter()
    if path:
        _save_checkpoint(path, layer, optimizer, state)
    weights = layer.weights()
    report = _report(state, per_epoch, held_out, arch, init, weights, norm_weight, table, log)
    return weights, report


def _split(sequences, seed):
    """(train, held out): a seeded tenth held out, at least one when there are two or more."""
    order = np.random.default_rng(seed).permutation(len(sequences))
    n = max(1, round(len(sequences) * HELD_OUT)) if len(sequences) > 1 else 0
    return [sequences[i] for i in sorted(order[n:])], [sequences[i] for i in sorted(order[:n])]


def _step_batch(train_set, step, per_epoch, seed):
    """The sequences of a step: each epoch a seeded shuffle, so a resumed run continues it."""
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(train_set))
    return [train_set[i] for i in order[index * BATCH:(index + 1) * BATCH]]


def _training_key(sequences, init, seed):
    digest = hashlib.sha256(json.dumps([seed, BATCH, LEARNING_RATE, HELD_OUT]).encode())
    for s in sequences:
        for array in (s.exit_states, s.top_ids, s.top_probs, np.array(s.start)):
            digest.update(np.ascontiguousarray(array).tobytes())
    for name in sorted(init):
        digest.update(name.encode() + np.ascontiguousarray(init[name], np.float32).tobytes())
    return digest.hexdigest()


def _save_checkpoint(path, layer, optimizer, state):
    partial = path.with_name(path.name + ".partial")
    torch.save({"layer": layer.state_dict(), "optimizer": optimizer.state_dict(),
                "state": state}, partial)
    os.replace(partial, path)


def _report(state, per_epoch, held_out, arch, init, weights, norm_weight, table, log):
    losses = state["losses"]
    if losses:
        first, last = np.mean(losses[:per_epoch]), np.mean(losses[-per_epoch:])
        log(f"adapter: {state['step']} steps ({state['step'] / per_epoch:.1f} epochs) in "
            f"{state['seconds']:.0f} s; training loss {first:.3f} (first epoch) -> "
            f"{last:.3f} (last)")
    if not held_out:
        log("adapter: no held-out sequences (fewer than two given); agreement not measured")
        return {}
    raw, before, after = (agreement(held_out, arch, w, norm_weight, table)
                          for w in (None, init, weights))
    log(f"adapter: held-out top-1 agreement with the verifier ({len(held_out)} sequences, "
        f"{sum(s.trained for s in held_out)} positions): raw exit {raw:.3f}, adapter at init "
        f"{before:.3f}, trained {after:.3f}")
    return {"held_out_positions": int(sum(s.trained for s in held_out)), "steps": state["step"],
            "seconds": round(state["seconds"]), "agreement_raw_exit": round(raw, 3),
            "agreement_adapter": round(after, 3)}
