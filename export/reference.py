"""The source model in float32 for export's gates, one weight in memory at a time.

The quality and fidelity gates and GPTQ's calibration pass run the model the user brought
at full precision. `Reference` is transformers' base model of the architecture (decoder
layers and final norm): each linear layer and norm reads its weights from the source just
before it runs and drops them after, and an MLP runs MLP_ROWS positions at a time. The vocabulary table never enters it: a batch's embeddings are the
table rows of its ids alone, and `scores` applies the lm_head a slice of rows at a time,
keeping per row a running top-1 and log-sum-exp. A pass holds one weight and one slice of
the table in float32, never the model and never a [rows, vocab] array.
"""
import numpy as np
from edgespec.engine import return_freed_memory

EMBEDDING, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
VOCAB_SLICE = 4096  # lm_head rows dequantized and multiplied at a time
MLP_ROWS = 512  # positions through an MLP at a time


class Reference:
    """The float32 model of `arch` over `weights` (HF name -> float32 array: a dict, or
    export/gguf.py's GGUFWeights, read as each part is needed)."""

    def __init__(self, arch, weights):
        import torch
        from transformers import AutoModel
        from transformers.initialization import no_init_weights
        from .source import hf_config
        self.arch, self.weights = arch, weights
        config = hf_config(arch)
        config.vocab_size = 1  # its own table stays unused: embeddings come from table_rows
        with no_init_weights():  # every weight that runs is read from `weights`
            self.model = AutoModel.from_config(config, dtype=torch.float32).eval()
        self.model.norm.weight.data = torch.from_numpy(weights[NORM])
        for i, layer in enumerate(self.model.layers):
            for name, part in layer.named_modules():
                if next(part.parameters(recurse=False), None) is None:
                    continue
                drop_weights(part)
                prefix = f"model.layers.{i}.{name}."
                part.register_forward_pre_hook(
                    lambda module, args, prefix=prefix: load_weights(module, prefix, weights))
                part.register_forward_hook(lambda module, args, out: drop_weights(module))
            layer.mlp.forward = by_rows(layer.mlp.forward)

    def hidden(self, sequences) -> list:
        """[len, hidden] float32 final-norm states of each token-id list: one pass of the
        batch, right-padded, through the layers (each read once, whatever the batch)."""
        import torch
        lengths = [len(s) for s in sequences]
        ids = np.zeros((len(sequences), max(lengths)), np.int64)
        mask = np.zeros(ids.shape, np.int64)
        for row, sequence in enumerate(sequences):
            ids[row, :len(sequence)] = sequence
            mask[row, :len(sequence)] = 1
        with torch.no_grad():
            out = self.model(inputs_embeds=torch.from_numpy(self.embeddings(ids, mask > 0)),
                             attention_mask=torch.from_numpy(mask), use_cache=False)
        return [out.last_hidden_state[row, :n].numpy() for row, n in enumerate(lengths)]

    def embeddings(self, ids, mask) -> np.ndarray:
        """[batch, len, hidden] input embeddings of `ids` where `mask` holds (zeros elsewhere),
        from the table rows of the distinct ids."""
        present, where = np.unique(ids[mask], return_inverse=True)
        rows = np.concatenate([table_rows(self.weights, EMBEDDING, range(i, i + 1))
                               for i in present.tolist()])
        if self.arch.embedding_scale:  # Gemma: transformers' scaled embedding, in float32
            rows = rows * np.float32(self.arch.embedding_scale)
        out = np.zeros((*ids.shape, rows.shape[1]), np.float32)
        out[mask] = rows[where.reshape(-1)]
        return out

    def scores(self, states, next_ids=None) -> tuple:
        """(top-1 id of each row of `states` [rows, hidden], log-probability of next_ids[i]
        after row i for the first len(next_ids) rows, or None): the lm_head applied a slice
        of vocabulary rows at a time."""
        import torch
        head = EMBEDDING if self.arch.tie_word_embeddings else HEAD
        x = torch.from_numpy(np.ascontiguousarray(states, np.float32))
        # per row: the largest logit so far, its id, and the sum of exp(logit - largest)
        best = torch.full((len(x),), -np.inf, dtype=torch.float64)
        top1 = torch.zeros(len(x), dtype=torch.int64)
        total = torch.zeros(len(x), dtype=torch.float64)
        nexts = torch.as_tensor([] if next_ids is None else list(next_ids), dtype=torch.int64)
        picked = torch.zeros(len(nexts), dtype=torch.float64)
        for start in range(0, self.arch.vocab_size, VOCAB_SLICE):
            stop = min(start + VOCAB_SLICE, self.arch.vocab_size)
            w = torch.from_numpy(table_rows(self.weights, head, range(start, stop)))
            logits = (x @ w.T).double()
            value, index = logits.max(-1)
            top1 = torch.where(value > best, index + start, top1)  # ties keep the lower id
            new_best = torch.maximum(best, value)
            total = total * torch.exp(best - new_best) + \
                torch.exp(logits - new_best[:, None]).sum(-1)
            best = new_best
            hit = torch.nonzero((nexts >= start) & (nexts < stop))[:, 0]
            picked[hit] = logits[hit, nexts[hit] - start]
        log_z = best[:len(nexts)] + torch.log(total[:len(nexts)])
        return top1.numpy(), None if next_ids is None else (picked - log_z).numpy()


def table_rows(weights, name, rows: range) -> np.ndarray:
    """Rows of a vocabulary table as float32: a GGUF's read and dequantized alone, a
    dict's sliced."""
    if hasattr(weights, "rows"):
        return weights.rows(name, rows)
    return weights[name][rows.start:rows.stop]


def load_weights(module, prefix, weights):
    import torch
    for name, param in module.named_parameters(recurse=False):
        param.data = torch.from_numpy(weights[prefix + name])


def drop_weights(module):
    import torch
    for param in module.parameters(recurse=False):
        param.data = torch.empty(0)
    # glibc keeps freed weights and activations otherwise, and the next part's come on top:
    # a pass would grow by a layer's worth each layer
    return_freed_memory()


def by_rows(mlp):
    """The MLP (position by position) on MLP_ROWS positions at a time: its activations are
    the intermediate size wide, for a batch of long sequences hundreds of megabytes."""
    import torch

    def forward(x):
        rows = x.reshape(-1, x.shape[-1])
        return torch.cat([mlp(rows[i:i + MLP_ROWS]) for i in range(0, len(rows), MLP_ROWS)]
                         ).reshape(x.shape[:-1] + (-1,))
    return forward
