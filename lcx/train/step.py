"""The train step: a pure function ``train_step(state, batch) -> (state, metrics)``, jitted in one place.

Loss: token cross-entropy from the float32 logits (``log_softmax``), weighted by ``batch["weights"]`` (1 on answer
tokens, 0 on padding) and divided by the batch's total weight - a mean over the masked tokens. Gradient
accumulation runs the micro-batches in a ``lax.scan`` inside the step, each contributing its weighted sum divided by
the *whole* batch's weight, so the accumulated gradient equals the full-batch gradient and the optimizer sees one
update per step. Batch arrays are ``[batch, seq_len]``: ``inputs``/``targets`` int32, ``weights`` and ``answer``
(1 on answer tokens) float32 - see ``lcx.data.batches``; a packed batch (documents packed into rows) adds
``positions`` and ``segment_ids`` int32, so that every document is rotated from position 0 and attends only to
itself.

Einsum-free; shapes: b batch, t positions, v vocab, a accumulation micro-batches.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from lcx.parallel import context as context_parallel
from lcx.parallel import sharding
from lcx.config import ModelConfig
from lcx.model.decoder import Decoder, abstract_params
from lcx.train import placement
from lcx.train.config import TrainConfig
from lcx.train.optim import lr_schedule, make_optimizer


@flax.struct.dataclass
class TrainState:
    """Everything a resumed run needs besides the data position (= ``step``, batches are a function of it).

    ``rng`` is the run's base PRNG key (raw uint32), checkpointed so that stochastic layers added later (dropout)
    resume identically by deriving a step's key as ``fold_in(rng, step)``; the current decoder is deterministic and
    the step does not use it yet.
    """

    step: jax.Array  # int32 scalar: optimizer steps taken = index of the next batch
    params: Any  # float32 master weights
    opt_state: Any
    rng: jax.Array  # uint32 [2]


def init_state(params, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                      rng=jax.random.key_data(jax.random.key(seed)))


@jax.custom_vjp
def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``-log_softmax(logits)[target]`` per token with its gradient written out: ``logits [b, t, v]`` float32,
    ``targets [b, t]`` -> ``[b, t]``; ``d/dlogits = g (softmax - onehot)``, elementwise.

    For rows split over a ``seq`` mesh axis: differentiating the gather of the target logit transposes it into a
    scatter-add, which the SPMD partitioner cannot split over ``seq`` (it replicated the logits' gradient on every
    device), and a one-hot contraction keeps a float32 ``[t, vocab]`` one-hot alive for the backward. Without a
    ``seq`` axis ``token_loss`` differentiates the gather as before: the gradients differ from these in the last bit,
    enough to move a bfloat16 run off its old trajectory."""
    return _nll_forward(logits, targets)[0]


def _nll_forward(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], (logp, targets)


def _nll_backward(res, g):
    logp, targets = res
    g = g[..., None]
    return jnp.exp(logp) * g - jnp.where(jnp.arange(logp.shape[-1]) == targets[..., None], g, 0.0), None


token_nll.defvjp(_nll_forward, _nll_backward)


def token_loss(model: ModelConfig, params, batch: dict[str, jax.Array], total_weight: jax.Array):
    """``(sum of weighted nll / total_weight, answer stats)`` of one (micro-)batch; the stats are sums over answer
    tokens: ``[nll, correct argmax predictions]``."""
    logits = Decoder(model).apply({"params": params}, batch["inputs"], positions=batch.get("positions"),
                                  segment_ids=batch.get("segment_ids"))  # [b, t, v] float32
    logits = logits.astype(jnp.float32)
    if context_parallel.sequence_axis() > 1:  # rows split over seq: the gradient written out (see token_nll)
        nll = token_nll(logits, batch["targets"])  # [b, t]
    else:
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), batch["targets"][..., None], axis=-1)[..., 0]
    answer = batch["answer"]
    correct = jnp.argmax(logits, axis=-1) == batch["targets"]
    stats = jnp.stack([jnp.sum(nll * answer), jnp.sum(correct * answer)])
    return jnp.sum(nll * batch["weights"]) / total_weight, jax.lax.stop_gradient(stats)


def train_step(state: TrainState, batch: dict[str, jax.Array], *, model: ModelConfig, grad_accum: int,
               optimizer: optax.GradientTransformation, schedule: Callable) -> tuple[TrainState, dict]:
    """One optimizer update on ``batch``. Metrics (float32 scalars): ``loss`` (the objective: weighted mean nll),
    ``answer_loss`` and ``accuracy`` (mean nll and argmax accuracy over answer tokens), ``grad_norm`` (before
    clipping), ``lr`` (of this step), ``answer_tokens``."""
    total = jnp.sum(batch["weights"])
    denom = jnp.maximum(total, 1e-6)  # a batch without weighted tokens gives loss 0, not NaN
    grad_fn = jax.value_and_grad(functools.partial(token_loss, model), has_aux=True)

    if grad_accum == 1:
        (loss, stats), grads = grad_fn(state.params, batch, denom)
    else:
        # Micro-batch j takes rows j, j + a, j + 2a, ...: each device's block of rows (batch split over "data")
        # feeds every micro-batch, so no rows move between devices (a plain [a, b/a] reshape would).
        micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, grad_accum, *x.shape[1:]), 0, 1), batch)

        def accumulate(carry, mb):
            g_sum, loss_sum, stats_sum = carry
            (loss, stats), g = grad_fn(state.params, mb, denom)
            return (jax.tree.map(jnp.add, g_sum, g), loss_sum + loss, stats_sum + stats), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((2,), jnp.float32))
        (grads, loss, stats), _ = jax.lax.scan(accumulate, init, micro)

    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    n_answer = jnp.sum(batch["answer"])
    per_answer = jnp.maximum(n_answer, 1.0)
    metrics = {"loss": loss, "answer_loss": stats[0] / per_answer, "accuracy": stats[1] / per_answer,
               "grad_norm": grad_norm, "lr": schedule(state.step), "answer_tokens": n_answer}
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new, jax.tree.map(lambda m: jnp.asarray(m, jnp.float32), metrics)


def batch_struct(train: TrainConfig, packed: bool = False, positions: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of one batch: ``[batch_size, seq_len]`` each (``packed``: with positions and segment ids;
    ``positions``: with positions - rows laid out for context parallelism, ``lcx.parallel.context.layout_batch``)."""
    shape = (train.batch_size, train.seq_len)
    out = {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32), "targets": jax.ShapeDtypeStruct(shape, jnp.int32),
           "weights": jax.ShapeDtypeStruct(shape, jnp.float32), "answer": jax.ShapeDtypeStruct(shape, jnp.float32)}
    if packed or positions:
        out["positions"] = jax.ShapeDtypeStruct(shape, jnp.int32)
    if packed:
        out["segment_ids"] = jax.ShapeDtypeStruct(shape, jnp.int32)
    return out


def _mesh_batch_struct(train: TrainConfig, packed: bool, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch of a run on ``mesh``: with a ``seq`` axis the rows carry their (laid-out) positions."""
    return batch_struct(train, packed, positions=sharding.axis_size(mesh, "seq") > 1)


def state_struct(model: ModelConfig, optimizer: optax.GradientTransformation) -> TrainState:
    """Abstract ``TrainState`` (shapes and dtypes only) of ``model`` under ``optimizer``."""
    params = abstract_params(dataclasses.replace(model, param_dtype="float32"))
    return jax.eval_shape(lambda p: init_state(p, optimizer, 0), params)


def jit_train_step(model: ModelConfig, train: TrainConfig, *, mesh: jax.sharding.Mesh | None = None,
                   state_sharding=None, batch_sharding=None):
    """``train_step`` jitted - the one place it is. The state is donated: its buffers are updated in place.

    Sharding hook: with ``mesh`` and the state/batch shardings (derived from ``lcx.model.param_axes``) the same pure
    function is jitted with ``in_shardings``/``out_shardings``; without them it runs on the default device.
    """
    fn = functools.partial(train_step, model=model, grad_accum=train.grad_accum, optimizer=make_optimizer(train),
                           schedule=lr_schedule(train))
    if mesh is None and state_sharding is None and batch_sharding is None:
        return jax.jit(fn, donate_argnums=0)
    return jax.jit(fn, in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None),
                   donate_argnums=0)


def step_shardings(model: ModelConfig, train: TrainConfig, mesh: jax.sharding.Mesh, packed: bool = False):
    """``(state shardings, batch shardings)`` of a run on ``mesh`` (``lcx.train.placement``; FSDP with
    ``train.fsdp``)."""
    optimizer = make_optimizer(train)
    state = placement.state_shardings(model, optimizer, state_struct(model, optimizer), mesh, fsdp=train.fsdp)
    return state, placement.batch_shardings(_mesh_batch_struct(train, packed, mesh), mesh)


@functools.lru_cache(maxsize=8)
def compile_train_step(model: ModelConfig, train: TrainConfig, *, mesh: jax.sharding.Mesh | None = None,
                       packed: bool = False):
    """The step compiled ahead of time for ``model`` and ``train``'s static shapes (on ``mesh``: with the state and
    batch shardings of ``step_shardings``, the state donated in place; ``packed``: batches carry positions and
    segment ids); cached, so a resumed or repeated run in the same process does not compile again."""
    state, batch = state_struct(model, make_optimizer(train)), _mesh_batch_struct(train, packed, mesh)
    if mesh is None:
        return jit_train_step(model, train).lower(state, batch).compile()
    state_sh, batch_sh = step_shardings(model, train, mesh, packed)
    jitted = jit_train_step(model, train, mesh=mesh, state_sharding=state_sh, batch_sharding=batch_sh)
    with sharding.use_mesh(mesh):
        return jitted.lower(placement.with_shardings(state, state_sh),
                            placement.with_shardings(batch, batch_sh)).compile()


__all__ = ["TrainState", "batch_struct", "compile_train_step", "init_state", "jit_train_step", "state_struct",
           "step_shardings", "token_loss", "token_nll", "train_step"]
