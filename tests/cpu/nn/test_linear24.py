"""SparseLinear24 and to_sparse24 on the CPU: validation, conversion reports, the dense path."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparseforge import SparseLinear24, prepare, sparsify_24, to_sparse24
from sparseforge.prune import is_nm, nm_mask
from sparseforge.semi import Sparse24Error, check_weight
from sparseforge.semi.cusparselt import CompressedWeight


def weight_24(m, k, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g)
    return (w * nm_mask(w)).to(dtype)


def linear_from(w, bias=True):
    linear = nn.Linear(w.shape[1], w.shape[0], bias=bias, dtype=w.dtype)
    with torch.no_grad():
        linear.weight.copy_(w)
    return linear


@pytest.mark.parametrize("weight,match", [
    (weight_24(32, 32, torch.float32), "float16 or bfloat16"),
    (weight_24(24, 32), "multiples of 16"),
    (weight_24(32, 40), "multiples of 16"),
    (torch.ones(32, 32, dtype=torch.float16), r"row 0, input columns 0\.\.3 .*not 2:4"),
    (torch.ones(32, dtype=torch.float16), "2-D"),
])
def test_check_weight_names_the_problem(weight, match):
    with pytest.raises(Sparse24Error, match=match):
        check_weight(weight)


def test_check_weight_rejects_nan_and_inf():
    for value in (float("nan"), float("inf")):
        w = weight_24(32, 32)
        w[3, 4] = value
        with pytest.raises(Sparse24Error, match="NaN or inf"):
            check_weight(w)


def test_check_weight_accepts_24_bf16():
    check_weight(weight_24(48, 64, torch.bfloat16))


def test_compressing_on_the_cpu_is_refused():
    with pytest.raises(Sparse24Error, match="CUDA device"):
        CompressedWeight(weight_24(32, 32))


def test_from_dense_cpu_forward_is_the_dense_result():
    w = weight_24(64, 32)
    linear = linear_from(w)
    layer = SparseLinear24.from_dense(linear)
    x = torch.randn(2, 5, 32, dtype=torch.float16)
    assert torch.equal(layer(x), F.linear(x, w, linear.bias))
    assert layer.decisions == []
    back = layer.to_dense()
    assert torch.equal(back.weight, w) and torch.equal(back.bias, linear.bias)


def test_from_dense_refuses_unpruned_weights():
    with pytest.raises(Sparse24Error, match="sparsify_24"):
        SparseLinear24.from_dense(nn.Linear(32, 32, dtype=torch.float16))


def test_state_dict_round_trip():
    layer = SparseLinear24.from_dense(linear_from(weight_24(32, 64)))
    fresh = SparseLinear24(64, 32)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh.weight, layer.weight) and torch.equal(fresh.bias, layer.bias)


def test_policy_is_validated():
    with pytest.raises(ValueError, match="policy must be one of"):
        SparseLinear24(16, 16, policy="fast")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.head = nn.Linear(64, 10)
        self.conv = nn.Conv2d(16, 32, 1)
        self.dense = nn.Linear(64, 64)


def test_to_sparse24_converts_pruned_layers_and_lists_the_rest():
    torch.manual_seed(0)
    model = Net()
    sparsify_24(model, exclude="dense")
    model.half()
    x = torch.randn(3, 64, dtype=torch.float16)
    before = model.fc2(model.fc1(x))
    report = to_sparse24(model)
    assert report.converted == ["fc1", "fc2"]
    reasons = {s.name: s.reason for s in report.skipped}
    assert "multiples of 16" in reasons["head"]
    assert "no convolution" in reasons["conv"]
    assert "not 2:4" in reasons["dense"]
    assert isinstance(model.fc1, SparseLinear24) and is_nm(model.fc1.weight)
    assert torch.equal(model.fc2(model.fc1(x)), before)
    assert "2 Linear layers now SparseLinear24" in str(report)


def test_to_sparse24_leaves_float32_models_with_a_reason():
    model = Net()
    sparsify_24(model)
    report = to_sparse24(model, include="fc")
    assert report.converted == []
    assert all("float16 or bfloat16" in s.reason for s in report.skipped if s.name.startswith("fc"))


def test_prepare_needs_a_cuda_model():
    model = nn.Sequential(SparseLinear24.from_dense(linear_from(weight_24(32, 32))))
    with pytest.raises(ValueError, match="CUDA device"):
        prepare(model, [16])
    with pytest.raises(ValueError, match="positive"):
        prepare(model, [0])


def test_torch_library_op_passes_opcheck():
    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    x = torch.randn(4, 3, 32, dtype=torch.float16)
    result = torch.library.opcheck(torch.ops.sparseforge.linear24.default,
                                   (x, layer._buffers["_device_anchor"], layer.bias.detach(), layer.layer_id, 48))
    assert set(result.values()) == {"SUCCESS"}


def test_torch_library_op_fake_shape_and_cpu_impl():
    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    x = torch.randn(4, 3, 32, dtype=torch.float16)
    anchor = layer._buffers["_device_anchor"]
    out = torch.ops.sparseforge.linear24(x, anchor, layer.bias, layer.layer_id, 48)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.sparseforge.linear24(mode.from_tensor(x), mode.from_tensor(anchor), None, 0, 48)
    assert fake.shape == (4, 3, 48)


class RecordingRuntime:
    """Stands in for the CUDA runtime so sparse_forward's glue (shapes, copies, keys) runs on the CPU."""

    def __init__(self, weight):
        self.weight, self.seen = weight, []

    def __call__(self, rows):
        self.seen.append((tuple(rows.shape), rows.is_contiguous(), rows.data_ptr() % 16))
        return F.linear(rows, self.weight)


def test_sparse_forward_glue_shapes_copies_and_runtime_key():
    w = weight_24(48, 32)
    layer = SparseLinear24.from_dense(linear_from(w, bias=False))
    stub = RecordingRuntime(w)
    layer._runtime, layer._runtime_key = stub, layer._current_key()
    x3 = torch.randn(2, 5, 32, dtype=torch.float16)
    assert torch.equal(layer.sparse_forward(x3), F.linear(x3, w))
    strided = torch.randn(32, 7, dtype=torch.float16).t()
    assert torch.equal(layer.sparse_forward(strided), F.linear(strided, w))
    misaligned = torch.randn(7 * 32 + 1, dtype=torch.float16)[1:].view(7, 32)
    assert torch.equal(layer.sparse_forward(misaligned), F.linear(misaligned, w))
    assert stub.seen == [((10, 32), True, 0), ((7, 32), True, 0), ((7, 32), True, 0)]
    assert layer.sparse_forward(torch.empty(0, 32, dtype=torch.float16)).shape == (0, 48)
    with torch.no_grad():
        layer.weight.mul_(2)  # an in-place change must invalidate the runtime (rebuilt: needs CUDA here)
    with pytest.raises(Sparse24Error, match="CUDA device"):
        layer.sparse_forward(x3)


def test_sparse_forward_rejects_wrong_inputs():
    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    with pytest.raises(Sparse24Error, match="takes 32"):
        layer.sparse_forward(torch.randn(3, 31, dtype=torch.float16))
    with pytest.raises(Sparse24Error, match="cast the input"):
        layer.sparse_forward(torch.randn(3, 32))


def test_copies_and_pickles_drop_the_runtime_and_get_their_own_op_id(tmp_path):
    import copy

    from sparseforge.ops import LAYERS

    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    layer._runtime, layer._runtime_key = RecordingRuntime(layer.weight), layer._current_key()
    twin = copy.deepcopy(layer)
    assert twin._runtime is None and twin._runtime_key is None and layer._runtime is not None
    assert twin.layer_id != layer.layer_id and LAYERS[twin.layer_id] is twin
    torch.save(layer, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    assert loaded._runtime is None and torch.equal(loaded.weight, layer.weight)
    assert LAYERS[loaded.layer_id] is loaded


@pytest.mark.parametrize("grad", [False, True])
def test_dense_path_refuses_what_the_sparse_path_does(grad):
    """On the CPU (and wherever the dense path runs) the same inputs fail with the same words, not deep in
    F.linear."""
    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    with torch.set_grad_enabled(grad):
        with pytest.raises(Sparse24Error, match="input has 31 features in its last dimension; this layer takes 32"):
            layer(torch.randn(3, 31, dtype=torch.float16))
        with pytest.raises(Sparse24Error, match=r"input dtype torch.float32, layer dtype torch.float16: cast the "
                                                r"input \(x.to\(torch.float16\)\)"):
            layer(torch.randn(3, 32))
        with pytest.raises(Sparse24Error, match="input on meta, layer on cpu: move one of them"):
            layer(torch.randn(3, 32, dtype=torch.float16, device="meta"))


def test_dense_path_leaves_dtype_casts_to_autocast():
    w = weight_24(48, 32)
    layer = SparseLinear24.from_dense(linear_from(w, bias=False))
    x = torch.randn(3, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = layer(x), F.linear(x, w)  # autocast casts x and the fp16 W to bf16 for both
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_dense_path_empty_input_and_non_contiguous_input():
    w = weight_24(48, 32)
    layer = SparseLinear24.from_dense(linear_from(w))
    assert layer(torch.empty(0, 32, dtype=torch.float16)).shape == (0, 48)
    assert layer(torch.empty(2, 0, 32, dtype=torch.float16)).shape == (2, 0, 48)
    strided = torch.randn(5, 64, dtype=torch.float16)[:, ::2]
    assert torch.allclose(layer(strided), F.linear(strided.contiguous(), w, layer.bias), rtol=1e-3, atol=1e-3)


def test_sparse_forward_names_the_device_before_the_dtype():
    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    with pytest.raises(Sparse24Error, match="input on meta, layer on cpu"):
        layer.sparse_forward(torch.randn(3, 32, device="meta"))  # float32 too: the device is the first fix


def test_prepare_and_to_sparse24_name_bad_arguments():
    model = nn.Sequential(SparseLinear24.from_dense(linear_from(weight_24(32, 32))))
    with pytest.raises(TypeError, match="widths must be a list"):
        prepare(model, "16")  # was read as the widths 1 and 6
    with pytest.raises(TypeError, match="widths must be integers.*1.5"):
        prepare(model, [1.5])  # was read as 1
    with pytest.raises(ValueError, match="policy must be one of"):
        to_sparse24(nn.Sequential(nn.Linear(8, 8)), policy="fast")  # was ignored with no 2:4 layer to build


def test_pin_checks_merges_and_forgets_the_runtime():
    from sparseforge.semi.decide import DENSE, GEMV, SPARSE

    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    assert layer.pinned == {} and layer.chosen_paths() == {}
    layer._runtime, layer._runtime_key = RecordingRuntime(layer.weight), layer._current_key()
    layer.pin({1: (GEMV, GEMV)})
    layer.pin({8: [DENSE, SPARSE]})
    assert layer.pinned == {1: (GEMV, GEMV), 8: (DENSE, SPARSE)}
    assert layer._runtime is None  # built again, from the pins, on the next CUDA call
    with pytest.raises(ValueError, match=r"pinned\[2\] must be"):
        layer.pin({2: ("csr", "csr")})
    assert layer.pinned == {1: (GEMV, GEMV), 8: (DENSE, SPARSE)}  # a refused pin changes nothing


def test_memory_bytes_counts_the_runtimes_copies_of_w():
    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    weight, bias = 48 * 32 * 2, 48 * 2
    assert layer.memory_bytes() == {"weight": weight, "weight_host": 0, "kernels": 0, "dense": 0, "bias": bias,
                                    "total": weight + bias}

    class Held(RecordingRuntime):
        def device_bytes(self):
            return {"compressed": 864, "packed": 864, "workspace": 100}

    layer._runtime = Held(layer.weight)
    assert layer.memory_bytes()["kernels"] == 1828 and layer.memory_bytes()["total"] == weight + bias + 1828


class PackedRuntime(RecordingRuntime):
    """A runtime whose packed copy writes W back, and which lets go of its dense W when asked."""

    def __init__(self, weight, drops=True):
        super().__init__(weight)
        self.gemv, self.drops, self.densified = object(), drops, 0

    def drop_dense(self):
        return self.drops

    def densify(self, out):
        self.densified += 1
        return out.copy_(self.weight)

    def device_bytes(self):
        return {"compressed": 0, "packed": 864, "workspace": 0, "dense": 0}


def test_release_dense_is_refused_without_a_runtime_that_drops_it_and_on_a_cpu():
    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    assert not layer.release_dense() and not layer.dense_on_host  # no runtime (nothing decided)
    layer._runtime, layer._runtime_key = PackedRuntime(layer.weight, drops=False), layer._current_key()
    assert not layer.release_dense() and layer.weight.device.type == "cpu"  # a width runs dense: W kept
    layer._runtime.drops = True
    assert not layer.release_dense() and not layer.dense_on_host  # on a CPU there is no other memory to move to


def test_a_layer_computing_elsewhere_than_its_weight_reads_w_from_the_packed_copy():
    """The glue of a layer whose dense W waits in host memory (its device anchor elsewhere: "meta" stands for
    the GPU here): memory counts the weight as host bytes, dense calls and densify_into read the packed copy,
    inputs are checked against the device it computes on, the torch.library op gets the anchor."""
    w = weight_24(48, 32)
    layer = SparseLinear24.from_dense(linear_from(w))
    layer._buffers["_device_anchor"] = torch.empty(0, dtype=torch.float16, device="meta")
    runtime = PackedRuntime(w)
    layer._runtime, layer._runtime_key = runtime, layer._current_key()
    assert layer.dense_on_host and layer.release_dense()  # already there: nothing to do
    assert layer.device.type == "meta"
    held = layer.memory_bytes()
    assert held["weight"] == 0 and held["weight_host"] == 48 * 32 * 2 and held["kernels"] == 864
    assert held["total"] == 864 + 48 * 2
    with pytest.raises(Sparse24Error, match="input on cpu, layer on meta"):
        layer(torch.randn(3, 32, dtype=torch.float16))
    out = torch.full((48, 32), float("nan"), dtype=torch.float16)
    assert layer.densify_into(out) is out and torch.equal(out, w) and runtime.densified == 1
    with torch.no_grad():
        layer.weight.mul_(2)  # an edit: the runtime no longer describes W, so W itself is read
    out.fill_(float("nan"))
    assert torch.equal(layer.densify_into(out), 2 * w) and runtime.densified == 1


def test_a_layer_pickled_before_it_had_a_device_anchor_gets_one_where_its_weight_is():
    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    state = layer.__dict__.copy()
    state["_buffers"] = {k: v for k, v in state["_buffers"].items() if k != "_device_anchor"}
    old = SparseLinear24.__new__(SparseLinear24)
    old.__setstate__(state)
    assert old.device == layer.weight.device and not old.dense_on_host
    assert "_device_anchor" not in old.state_dict()


def test_assigning_a_state_dict_moves_the_device_anchor_with_the_weight():
    """saving.load builds layers on "meta" and assigns the saved tensors: the layer computes where they are."""
    w = weight_24(48, 32)
    source = SparseLinear24.from_dense(linear_from(w))
    with torch.device("meta"):
        layer = SparseLinear24(32, 48, dtype=torch.float16)
    assert layer.device.type == "meta"
    layer.load_state_dict(source.state_dict(), assign=True)
    assert layer.device.type == "cpu" and torch.equal(layer.weight, w) and not layer.dense_on_host


def test_prepare_needs_a_cuda_device_and_release_waits_for_graphs_captured_before_prepare():
    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    with pytest.raises(ValueError, match="CUDA device"):
        layer.prepare([1])
    runtime = PackedRuntime(layer.weight)
    runtime.drop_dense = lambda: pytest.fail("a graph captured before prepare may still read the device W")
    layer._runtime, layer._runtime_key = runtime, layer._current_key()
    layer._capture_fallbacks[1] = "dense in a graph captured before prepare"
    assert not layer.release_dense()


def test_a_state_dict_without_the_weight_leaves_a_host_weight_where_it_is():
    """load_state_dict(strict=False) of the bias alone (an adapter, say) moves nothing and keeps the runtime's W
    key; the same Parameter object stays the layer's weight."""
    w = weight_24(48, 32)
    layer = SparseLinear24.from_dense(linear_from(w))
    layer._buffers["_device_anchor"] = torch.empty(0, dtype=torch.float16, device="meta")  # stands for the GPU
    weight = layer.weight
    layer.load_state_dict({"bias": torch.ones(48, dtype=torch.float16)}, strict=False)
    assert layer.weight is weight and layer.weight.device.type == "cpu" and torch.equal(layer.weight, w)
    assert torch.equal(layer.bias, torch.ones(48, dtype=torch.float16))


def test_a_move_to_where_the_layer_is_keeps_its_runtime_and_a_cast_forgets_it():
    """model.to(its own device) or .half() on an fp16 model (pipelines move models they are given) keeps the
    runtime and its decisions; a real cast or move builds them again."""
    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    runtime = PackedRuntime(layer.weight)
    layer._runtime, layer._runtime_key = runtime, layer._current_key()
    layer.to("cpu")
    layer.half()
    assert layer._runtime is runtime and layer._runtime_key == layer._current_key()
    layer.to(torch.bfloat16)
    assert layer._runtime is None and layer.weight.dtype == torch.bfloat16 and layer.device.type == "cpu"


def test_a_dense_call_captured_without_the_packed_copy_is_refused(monkeypatch):
    """A layer whose dense W waits in host memory (the device stood for by "meta") and whose runtime is gone
    (an edit, a pin) cannot write W inside a capture: a host copy there would break it."""
    layer = SparseLinear24.from_dense(linear_from(weight_24(48, 32)))
    layer._buffers["_device_anchor"] = torch.empty(0, dtype=torch.float16, device="meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="prepare it before capturing"):
        layer.densify_into(torch.empty(48, 32, dtype=torch.float16))
