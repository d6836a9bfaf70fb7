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
        if torch_internals.TORCH_RELEASE >= (2, 13):  # not needed there: never bound
            return not _exists(name)
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


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _private_torch_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Every private torch name a module reaches: ``torch.<...>._name`` attribute chains
    (also through a name bound to a torch module or object: ``from torch import nn``,
    ``import torch.optim as o``), imports of private torch modules and of private names
    (``from torch.x import _name``), and private torch attributes patched with
    ``setattr(torch_thing, "_name", ...)``."""
    found = []
    torch_names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_names.add(alias.asname or "torch")
                    if any(_private(p) for p in alias.name.split(".")):
                        found.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(_private(p) for p in node.module.split(".")):
                found.append((node.lineno, node.module))
            for alias in node.names:
                if _private(alias.name):
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
                torch_names.add(alias.asname or alias.name)

    def dotted(node: ast.AST) -> list[str] | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in torch_names:
            return [node.id] + parts[::-1]
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = dotted(node)
            if chain is not None and any(_private(p) for p in chain[1:]):
                found.append((node.lineno, ".".join(chain)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("setattr", "delattr") and len(node.args) >= 2:
            target, name = node.args[0], node.args[1]
            if dotted(target) is not None and isinstance(name, ast.Constant) \
                    and isinstance(name.value, str) and _private(name.value):
                found.append((node.lineno, f"{node.func.id}(..., {name.value!r})"))
    return sorted(set(found))


def test_the_guard_sees_every_way_to_reach_a_private_name():
    source = (
        "import torch\n"
        "from torch.utils import _pytree\n"
        "from torch.optim.optimizer import _global_optimizer_pre_hooks\n"
        "from torch import nn\n"
        "import torch.optim as opt\n"
        "x = torch._C._foo\n"
        "y = nn.Module._call_impl\n"
        "z = opt.optimizer._hooks\n"
        "torch.utils.data._private = 1\n"
        "setattr(torch.optim, '_patched', 1)\n"
        "ok = torch.nn.Linear\n")
    found = {name for _, name in _private_torch_names(ast.parse(source))}
    assert found == {"torch.utils._pytree", "torch.optim.optimizer._global_optimizer_pre_hooks",
                     "torch._C._foo", "torch._C", "nn.Module._call_impl",
                     "opt.optimizer._hooks", "torch.utils.data._private",
                     "setattr(..., '_patched')"}, found


def test_private_torch_names_are_used_only_through_torch_internals():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "_runtime/torch_internals.py":
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
    """The compiled backend changes no dynamo setting of the process (a user's own
    torch.compile keeps its configuration); results match plain PyTorch."""
    monkeypatch.setenv("POPTORCH_TORCH_COMPILE_BACKEND", "aot_eager")
    import torch._dynamo
    before = torch._dynamo.config.get_config_copy()
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
    assert pop.backendInUse in ("compiled", "compiling")
    assert pop._program.selector.compiled is not None
    assert torch._dynamo.config.get_config_copy() == before
