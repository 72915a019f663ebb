"""Entry points: backend="qfuse" without an import, options, install/uninstall, FX graph cache, debug."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import qfuse
from qfuse.config import pass_skipping_caches_off
from qfuse.platform import current_platform
from qfuse.passes.families import PATTERN_FAMILIES
from qfuse.passes.core.manager import ComposedPass, QfusePass, prepare_pass
from tests.helpers import compile_and_run
from tests.passes.test_reference_linear import int_mm_linear, operands


@pytest.mark.slow  # a fresh Python with Inductor's caches off: CI's slow tier
def test_backend_found_through_entry_point_without_import():
    script = textwrap.dedent("""
        import sys, torch
        from torch._dynamo import list_backends
        assert "qfuse" not in sys.modules
        assert "qfuse" in list_backends()
        w = torch.randint(-127, 128, (16, 32), dtype=torch.int8)
        def linear(x):
            s = x.abs().amax(-1, keepdim=True) / 127.0
            q = torch.clamp(torch.round(x / s), -128, 127).to(torch.int8)
            return torch._int_mm(q, w.t()).float() * s * 0.01
        x = torch.randn(8, 32)
        torch.testing.assert_close(torch.compile(linear, backend="qfuse")(x), linear(x))
        import qfuse
        assert qfuse.recent_reports()[-1].fused
        print("ok")
    """)
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(Exception, match=r"unknown option 'kernal'.*qfuse options are \['debug', 'debug_dir'"):
        torch.compile(lambda x: x + 1, backend="qfuse", options={"kernal": "torch"})(torch.ones(2))


def test_inductor_options_pass_through():
    x, w, w_scale, bias = operands((5, 64))
    out, report = compile_and_run(int_mm_linear, x, w, w_scale, bias, kernel="reference", max_autotune=False)
    assert report.fused[0].kernel == "reference"
    torch.testing.assert_close(out, int_mm_linear(x, w, w_scale, bias), rtol=1e-4, atol=1e-4)


class CountingPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "counting-pass"


def test_install_composes_with_an_existing_pass_and_uninstall_restores_it():
    existing = CountingPass()
    x, w, w_scale, bias = operands((5, 64))
    with torch._inductor.config.patch(post_grad_custom_post_pass=existing):
        marker = qfuse.graphs_compiled()
        with qfuse.installed(kernel="reference"):
            out = torch.compile(int_mm_linear)(x, w, w_scale, bias)
        assert torch._inductor.config.post_grad_custom_post_pass is existing
        assert existing.calls == 1
        (report,) = qfuse.reports_since(marker)
        assert report.fused[0].kernel == "reference"
        torch.testing.assert_close(out, int_mm_linear(x, w, w_scale, bias), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="without a matching qfuse.install"):
        qfuse.uninstall()


def test_backend_composes_with_a_configured_pass():
    existing = CountingPass()
    x, w, w_scale, bias = operands((5, 64))
    with torch._inductor.config.patch(post_grad_custom_post_pass=existing):
        _, report = compile_and_run(int_mm_linear, x, w, w_scale, bias)
    assert existing.calls == 1 and report.fused


def test_prepare_pass_composes_after_the_existing_pass_with_the_options_applied():
    existing = CountingPass()
    qfuse_pass, slots = prepare_pass({"post_grad_custom_post_pass": existing}, qfuse.QfuseConfig(kernel="torch"),
                                     verify=True)
    post_grad_pass, joint_pass = slots["post_grad_custom_post_pass"], slots["joint_custom_post_pass"]
    assert isinstance(post_grad_pass, ComposedPass) and post_grad_pass.passes == [existing, qfuse_pass]
    assert qfuse_pass.config == qfuse.QfuseConfig(kernel="torch", verify=True)
    assert isinstance(joint_pass, QfusePass) and joint_pass.stage == "joint" and joint_pass.config == qfuse_pass.config
    alone, same = prepare_pass({})
    assert same["post_grad_custom_post_pass"] is alone and alone.config == qfuse.QfuseConfig.from_env()
    assert torch.ops.qfuse.scaled_mm.default in torch._inductor.lowering.lowerings


def test_under_freezing_qfuse_runs_before_the_constants_are_folded():
    """Freezing folds every computation on constants before the post-grad passes: the GPTQ form's
    unpack and dequantize would become a float weight. qfuse runs in the joint-graph stage there,
    once (one report per graph), and fuses it as without freezing."""
    from tests.peers import weight_only_models as wo

    model = wo.gptq_packed_int4(torch.bfloat16)
    x = wo.example_input(256, torch.bfloat16)
    for freezing in (False, True):
        torch._dynamo.reset()
        with torch._inductor.config.patch(freezing=freezing), pass_skipping_caches_off(), torch.no_grad():
            marker = qfuse.graphs_compiled()
            out = torch.compile(model, backend="qfuse")(x)
            (report,) = qfuse.reports_since(marker)
        (record,) = report.records
        assert record.fused and record.family == "int4_weight_only", (freezing, record)
        torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)


def test_installed_pass_takes_both_stages_and_uninstall_restores_them():
    joint = CountingPass()
    with torch._inductor.config.patch(joint_custom_post_pass=joint):
        with qfuse.installed() as qfuse_pass:
            installed_joint = torch._inductor.config.joint_custom_post_pass
            assert installed_joint.passes[0] is joint and installed_joint.passes[1].stage == "joint"
            assert installed_joint.passes[1].config == qfuse_pass.config
        assert torch._inductor.config.joint_custom_post_pass is joint


def test_installs_nest_and_each_uninstall_restores_the_pass_before_it():
    existing = CountingPass()
    with torch._inductor.config.patch(post_grad_custom_post_pass=existing):
        with qfuse.installed(kernel="torch") as outer:
            with qfuse.installed(kernel="reference") as inner:
                assert torch._inductor.config.post_grad_custom_post_pass.passes == [existing, inner]  # outer replaced
            assert torch._inductor.config.post_grad_custom_post_pass.passes == [existing, outer]
        assert torch._inductor.config.post_grad_custom_post_pass is existing


def test_the_cache_key_covers_every_source_file_of_the_package():
    """A change to kernel choice or a lowering changes the code a cache entry holds: the pass's key hashes them all
    (it once hashed qfuse/passes only, and a changed lowering was served from the cache)."""
    from pathlib import Path

    from qfuse.passes.core.manager import source_files

    package = Path(qfuse.__file__).resolve().parent
    assert set(source_files()) == {str(path) for path in package.rglob("*.py")}
    assert {str(package / "lowerings" / "dispatch.py"), str(package / "kernels" / "registry.py")} <= set(source_files())


def test_uuid_follows_the_config():
    assert QfusePass(qfuse.QfuseConfig()).uuid() == QfusePass(qfuse.QfuseConfig()).uuid()
    assert QfusePass(qfuse.QfuseConfig()).uuid() != QfusePass(qfuse.QfuseConfig(), stage="joint").uuid()
    assert QfusePass(qfuse.QfuseConfig()).uuid() != QfusePass(qfuse.QfuseConfig(kernel="reference")).uuid()
    assert QfusePass(qfuse.QfuseConfig()).uuid() == QfusePass(qfuse.QfuseConfig(debug=True)).uuid()


def test_warm_fx_graph_cache_hit_is_correct(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._dynamo.utils import counters

    x, w, w_scale, bias = operands((5, 64))
    expected = int_mm_linear(x, w, w_scale, bias)
    with torch._inductor.config.patch(force_disable_caches=False, fx_graph_cache=True, fx_graph_remote_cache=False):
        counters.clear()
        for _ in range(2):
            torch._dynamo.reset()
            out = torch.compile(int_mm_linear, backend="qfuse")(x, w, w_scale, bias)
            torch.testing.assert_close(out, expected)
        assert counters["inductor"]["fxgraph_cache_miss"] == 1
        assert counters["inductor"]["fxgraph_cache_hit"] == 1
        torch._dynamo.reset()  # another kernel is another cache entry
        torch.compile(int_mm_linear, backend="qfuse", options={"kernel": "reference"})(x, w, w_scale, bias)
        assert counters["inductor"]["fxgraph_cache_miss"] == 2


def test_debug_writes_graphs_and_report(tmp_path):
    x, w, w_scale, bias = operands((5, 64))
    _, report = compile_and_run(int_mm_linear, x, w, w_scale, bias, kernel="torch", debug=True, debug_dir=str(tmp_path))
    graph_dir = tmp_path / f"pid{os.getpid()}" / report.graph_name
    assert "torch.ops.aten._int_mm.default" in (graph_dir / "0_before.py").read_text()
    after = (graph_dir / "1_after_reference_linear.py").read_text()
    assert "torch.ops.qfuse.scaled_mm.default" in after and "torch.ops.aten._int_mm" not in after
    last = graph_dir / f"{len(PATTERN_FAMILIES)}_after_{PATTERN_FAMILIES[-1]}.py"
    assert last.read_text() == after  # torch kernel: nothing folded, one linear: no siblings
    assert "fused      _int_mm + dequant epilogue  [reference_linear]" in (graph_dir / "report.txt").read_text()
    assert json.loads((graph_dir / "report.json").read_text())["linears"][0]["kernel"] == "torch"
    assert "== activation_quant ==" in (graph_dir / "patterns.txt").read_text()


def test_debug_under_freezing_dumps_the_graph_before_each_stage_and_the_patterns_once(tmp_path):
    from tests.peers import weight_only_models as wo

    model, x = wo.gptq_packed_int4(torch.bfloat16), wo.example_input(256, torch.bfloat16)
    torch._dynamo.reset()
    with torch._inductor.config.patch(freezing=True), pass_skipping_caches_off(), torch.no_grad():
        marker = qfuse.graphs_compiled()
        torch.compile(model, backend="qfuse", options={"debug": True, "debug_dir": str(tmp_path)})(x)
        (report,) = qfuse.reports_since(marker)
    graph_dir = tmp_path / f"pid{os.getpid()}" / report.graph_name
    assert "aten.addmm" in (graph_dir / "0_before.py").read_text()  # the joint stage, before the fold
    assert "qfuse.int4_weight_only_mm" in (graph_dir / "0_before_post_grad.py").read_text()
    assert "== int4_weight_only ==" in (graph_dir / "patterns.txt").read_text()


def test_unknown_forced_kernel_is_an_error():
    x = torch.randn(4, 256)
    w = torch.randint(-127, 128, (8, 256), dtype=torch.int8)

    def linear(x):
        q = torch.clamp(torch.round(x / 0.1), -128, 127).to(torch.int8)
        return torch._int_mm(q, w.t()).float() * 0.1 * 0.01

    with pytest.raises(Exception, match="unknown qfuse kernels"):
        torch.compile(linear, backend="qfuse", options={"kernel": "cublaslt"})(x)


def test_forced_kernel_that_cannot_run_here_is_an_error_with_its_reason():
    x, w, w_scale, bias = operands((5, 64))
    with pytest.raises(Exception, match="forced kernel 'cutlass' cannot run .*: CUTLASS runs on NVIDIA GPUs, not on CPU"):
        torch.compile(int_mm_linear, backend="qfuse", options={"kernel": "cutlass"})(x, w, w_scale, bias)


@pytest.mark.parametrize("shape", [(33, 64), (2, 9, 64)], ids=["M33", "3D"])
def test_default_cpu_kernel_of_this_machine_matches_eager(shape):
    """Whatever the CPU priority list picks here (zentorch on Zen with zentorch installed, else
    onednn on AVX-512 VNNI / AMX, else torch), the compiled linear matches eager. (At a static
    M = 1 the per-token scale is one value: a per-tensor scheme, which zentorch does not take.)"""
    x, w, w_scale, bias = operands(shape)
    out, report = compile_and_run(int_mm_linear, x, w, w_scale, bias, dynamic=True)
    platform = current_platform("cpu")
    expected_kernel = next(name for name, ok in (
        ("zentorch", platform.cpu_is_amd_zen and platform.cpu_has_avx512_vnni and platform.has("zentorch")),
        ("onednn", platform.cpu_has_int8_dot_products),
        ("torch", True),
    ) if ok)
    assert [record.kernel for record in report.fused] == [expected_kernel]
    torch.testing.assert_close(out, int_mm_linear(x, w, w_scale, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"])
def test_every_inductor_mode_is_accepted(mode):
    """torch.compile(model, backend="qfuse", mode=...) takes Inductor's modes (CUDA graphs need a
    GPU: on CPU Inductor skips them, as it does without qfuse)."""
    x, w, w_scale, bias = operands((5, 64))
    marker = qfuse.graphs_compiled()
    out = torch.compile(int_mm_linear, backend="qfuse", mode=mode)(x, w, w_scale, bias)
    (report,) = qfuse.reports_since(marker)
    assert [record.fused for record in report.records] == [True]
    torch.testing.assert_close(out, int_mm_linear(x, w, w_scale, bias), rtol=1e-4, atol=1e-4)
