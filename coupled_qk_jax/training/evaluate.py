"""Token-level evaluation: cross-entropy and perplexity over a whole split, every token scored exactly once.

The split's token stream is ``[eot] + tokens`` cut into non-overlapping windows of T (``data.pipeline.eval_batches``
with ``bos_id=eot``), so each of its N tokens is a target exactly once, the first predicted from the document
separator. Padding (the last partial window, filler rows) has target -100 and is not counted. Per batch the device
returns the summed NLL (float32) and the token count; the host accumulates them in float64 / Python int, so the
result does not depend on the batch size beyond float32 rounding inside one batch.

    loss = sum(NLL) / tokens        ppl = exp(loss)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

from coupled_qk_jax import sharding as shd
from coupled_qk_jax.data.pipeline import eval_batches, num_eval_batches


def evaluate_tokens(eval_step: Callable, params: Any, tokens: np.ndarray, seq_len: int, global_batch_size: int,
                    mesh: Mesh, *, bos_id: int | None, max_batches: int = 0) -> dict[str, float | int]:
    """Mean token NLL and perplexity of a split.

    Args:
      eval_step: ``(params, batch) -> (nll_sum, count)``, e.g. ``sharding.jit_sharded(steps.make_eval_step(graphdef),
        mesh, params_shardings)``.
      tokens: [N] token ids of the split (this host reads only its rows' windows: row r of batch b is window
        b * global_batch_size + r, and the host's rows are sharding.host_batch_rows').
      seq_len: T.
      global_batch_size: windows per batch over all hosts.
      bos_id: the end-of-text id; with it all N tokens are scored, without it N - 1.
      max_batches: 0 = the whole split; otherwise only the first ``max_batches`` batches (a cheaper estimate).

    Returns:
      {"loss": mean NLL in nats, "ppl": exp(loss), "tokens": number of scored tokens}; loss and ppl are floats, or
      float64 arrays [S] when ``eval_step`` is vmapped over a seed axis of ``params``.
    """
    # The training rule: a host feeds the rows its devices hold, so hosts that hold the same rows (a tensor axis
    # across hosts) feed the same windows, and a host whose rows are not one block (TPU pods) still feeds its own.
    rows = shd.host_batch_rows(mesh, jax.process_index(), global_batch_size)
    total = num_eval_batches(int(tokens.shape[0]), seq_len, global_batch_size, bos_id=bos_id)
    limit = total if max_batches <= 0 else min(total, max_batches)
    outs = []
    batches = eval_batches(tokens, seq_len, global_batch_size, bos_id=bos_id, rows=rows)
    for i, batch in enumerate(batches):
        if i == limit:
            break
        outs.append(eval_step(params, shd.global_batch(batch, mesh)))  # async dispatch; read back below
    # float64 accumulation on the host; a seed-parallel eval step returns [S] sums (one per seed, same count).
    nll = np.sum([np.asarray(s, np.float64) for s, _ in outs], axis=0)
    count = sum(int(np.asarray(c).reshape(-1)[0]) for _, c in outs)
    loss = nll / max(count, 1)
    ppl = np.where(loss < 700, np.exp(np.minimum(loss, 700)), np.inf)
    if np.ndim(loss) == 0:
        return {"loss": float(loss), "ppl": float(ppl), "tokens": count}
    return {"loss": loss, "ppl": ppl, "tokens": count}
