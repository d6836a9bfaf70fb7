"""The private PyTorch names we rely on live in one module
(``poptorch._runtime.torch_internals``) and still exist in this torch; dynamo settings
are scoped to our own traces."""
import ast
import copy
import pathlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import poptorch
from poptorch._runtime import torch_internals

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "poptorch"
# DataLoader's own private members, used where we subclass or stop it (listed in
# torch_internals.REQUIRED and checked below).
DATALOADER_MODULES = {"data/loader.py", "data/faults.py"}


def _exists(name: str) -> bool:
    try:
        torch_internals.resolve(name)
    except (ImportError, AttributeError):
        return False
    return True


def _fallback_runs(name: str) -> bool:
    """Whether the binding of ``name`` (an entry of FALLBACKS) runs its fallback."""
    if name == "torch._C._dynamo.guards.TensorGuards":
        return torch_internals.tensor_inputs_check((torch.zeros(2),)) is None
    if name == "torch._dynamo.config.enable_dynamo_decompositions":
        return torch_internals.dynamo_eager_numerics() == {}
    raise AssertionError(f"no check of the fallback of {name}: add one here")


@pytest.mark.parametrize("name", sorted(torch_internals.REQUIRED))
def test_every_private_torch_name_we_use_exists(name):
    """A name this torch lacks fails here, unless it has a fallback (FALLBACKS): then the
    fallback must be what runs, and the test says so (a warning naming both)."""
    exists = _exists(name)
    fallback = torch_internals.FALLBACKS.get(name)
    if fallback is not None:
        assert _fallback_runs(name) is not exists, (
            f"torch {torch.__version__} {'has' if exists else 'lacks'} {name}, but its "
            f"binding {'runs' if not exists else 'does not run'} the fallback")
        if not exists:
            warnings.warn(f"torch {torch.__version__} lacks {name}: the fallback runs "
                          f"({fallback})", UserWarning, stacklevel=1)
        return
    if not exists:
        pytest.fail(f"torch {torch.__version__} no longer has {name} "
                    f"(used for: {torch_internals.REQUIRED[name]})")


def test_every_fallback_is_of_a_listed_name():
    assert set(torch_internals.FALLBACKS) <= set(torch_internals.REQUIRED)


@pytest.mark.parametrize("name", sorted(torch_internals.FALLBACKS))
def test_a_missing_name_runs_its_fallback(name, monkeypatch):
    """The fallback of each entry, run as on a torch release without that name."""
    if name == "torch._C._dynamo.guards.TensorGuards":
        import torch._C._dynamo.guards as guards
        monkeypatch.delattr(guards, "TensorGuards", raising=False)
    else:
        import torch._dynamo
        monkeypatch.delattr(torch._dynamo.config, "enable_dynamo_decompositions",
                            raising=False)
    assert not _exists(name)
    assert _fallback_runs(name)


def test_traced_update_rounds_as_eager_with_dynamo_eager_numerics():
    """torch.optim's SGD update ``param.add_(buf, alpha=-lr)`` traced under
    dynamo_eager_numerics() gives bitwise the eager result (torch 2.11 rewrites it into
    two roundings otherwise)."""
    torch.manual_seed(0)
    param, buf = torch.randn(4096), torch.randn(4096)
    expected = param.clone().add_(buf, alpha=-0.01)

    def update(p, b):
        return p.clone().add_(b, alpha=-0.01)
    with torch_internals.dynamo_config_patch(**torch_internals.dynamo_eager_numerics()):
        torch._dynamo.reset()
        traced = torch.compile(update, backend="aot_eager", fullgraph=True)(param, buf)
    torch._dynamo.reset()
    assert torch.equal(traced, expected)


@pytest.mark.parametrize("cls,names", sorted(torch_internals.REQUIRED_ON_INSTANCES.items()))
def test_private_instance_attributes_exist(cls, names):
    instance = torch_internals.resolve(cls)([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    missing = [n for n in names if not hasattr(instance, n)]
    assert not missing, f"torch {torch.__version__}: {cls} instances lack {missing}"


def _private_torch_names(tree: ast.AST) -> list[tuple[int, str]]:
    """``torch.<...>._name`` attribute chains and imports of private torch modules."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch":
                dotted = ["torch"] + parts[::-1]
                if any(p.startswith("_") and not p.startswith("__") for p in dotted):
                    found.append((node.lineno, ".".join(dotted)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names]
            for module in modules:
                if module.startswith("torch") and any(
                        p.startswith("_") and not p.startswith("__")
                        for p in module.split(".")):
                    found.append((node.lineno, module))
    return found


def test_private_torch_names_are_used_only_through_torch_internals():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in ("_runtime/torch_internals.py",) or rel in DATALOADER_MODULES:
            continue
        for line, name in _private_torch_names(ast.parse(path.read_text())):
            bad.append(f"{rel}:{line}: {name}")
    assert not bad, ("use poptorch._runtime.torch_internals (a binding with its reason) "
                     "instead of:\n" + "\n".join(bad))


def test_the_reader_sees_private_names():
    """So that the test above cannot pass by finding nothing."""
    text = (SRC / "_runtime" / "torch_internals.py").read_text()
    assert len(_private_torch_names(ast.parse(text))) > 10


def test_compiled_training_leaves_dynamo_settings_as_they_were(monkeypatch):
    """trace_autograd_ops is on while our program traces (the call is compiled) and off
    again afterwards for the rest of the process; results match plain PyTorch."""
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "aot_eager")
    import torch._dynamo
    assert torch._dynamo.config.trace_autograd_ops is False
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref = copy.deepcopy(model)

    class WithLoss(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            out = self.inner(x)
            return out, F.mse_loss(out, y)

    opts = poptorch.Options()
    opts.Jit.backend("inductor")
    pop = poptorch.trainingModel(WithLoss(model), opts,
                                 torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _step in range(3):  # eager, compiles, replays
        x, y = torch.randn(4, 4), torch.randn(4, 2)
        _, loss = pop(x, y)
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach())
    compiled = pop._program.compiled
    assert compiled is not None and compiled._traced and not compiled.failed
    assert torch._dynamo.config.trace_autograd_ops is False
