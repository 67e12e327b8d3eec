"""bench/hlo_count.py: kernels counted from a compiled program's HLO text."""

import jax
import jax.numpy as jnp
import pytest

from bench.hlo_count import kernel_count

# A hand-written optimized module: ENTRY launches a copy and a loop whose body launches two
# fusions (one calling a reducer) and a custom call, and whose condition launches one fusion;
# a `call` to an outlined computation (as XLA's command buffers make) launches one more fusion.
HLO = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_reduce (p: f32[4]) -> f32[] {
  %p = f32[4]{0} parameter(0)
  %zero = f32[] constant(0)
  ROOT %r = f32[] reduce(%p, %zero), dimensions={0}, to_apply=%add
}

%fused_tanh (p.1: f32[4]) -> f32[4] {
  %p.1 = f32[4]{0} parameter(0)
  ROOT %t = f32[4]{0} tanh(%p.1)
}

%body (state: (s32[], f32[4])) -> (s32[], f32[4]) {
  %state = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[4]{0} get-tuple-element(%state), index=1
  %y = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_tanh
  %s = f32[] fusion(%y), kind=kInput, calls=%fused_reduce
  %g = f32[4]{0} custom-call(%y), custom_call_target="__cublas$gemm"
  ROOT %next = (s32[], f32[4]{0}) tuple(%i, %g)
}

%cond (state.1: (s32[], f32[4])) -> pred[] {
  %state.1 = (s32[], f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%state.1), index=0
  ROOT %lt = pred[] fusion(%i.1), kind=kLoop, calls=%fused_tanh
}

%outlined (x.2: f32[4]) -> f32[4] {
  %x.2 = f32[4]{0} parameter(0)
  ROOT %u = f32[4]{0} fusion(%x.2), kind=kLoop, calls=%fused_tanh
}

ENTRY %main (x.3: f32[4]) -> f32[4] {
  %x.3 = f32[4]{0} parameter(0)
  %c = f32[4]{0} copy(%x.3)
  %zero.1 = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero.1, %c)
  %loop = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  %out = f32[4]{0} get-tuple-element(%loop), index=1
  ROOT %called = f32[4]{0} call(%out), to_apply=%outlined
}
"""


def test_counts_launching_ops_and_follows_control_flow_not_fusion_bodies():
    assert kernel_count(HLO) == 1 + 3 + 1 + 1  # copy, loop body, loop condition, outlined call
    assert kernel_count(HLO, loop_body=True) == 3 + 1


def test_a_compiled_loop_counts_more_kernels_with_more_independent_matmuls():
    """On XLA:CPU's real output: each extra matmul of its own shape in the loop body is at
    least one more kernel per iteration."""

    def loop(n_matmuls):
        def f(ws, x, n):
            def body(i, x):
                return x + sum(jnp.tanh(x[:, : w.shape[0]] @ w).sum() for w in ws)

            return jax.lax.fori_loop(0, n, body, x)

        ws = [jnp.ones((8 * (i + 1), 8 * (i + 2))) for i in range(n_matmuls)]
        return jax.jit(f).lower(ws, jnp.ones((4, 64)), 3).compile().as_text()

    one, three = (kernel_count(loop(n), loop_body=True) for n in (1, 3))
    assert three >= one + 2


def test_loop_body_needs_exactly_one_loop():
    text = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile().as_text()
    assert kernel_count(text) >= 1
    with pytest.raises(ValueError, match="exactly one while loop"):
        kernel_count(text, loop_body=True)


def test_text_without_an_entry_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        kernel_count("HloModule m\n")
