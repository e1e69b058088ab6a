import re

import keras
import pytest

from keras_hub_autodist import DeviceMeshTypeError
from keras_hub_autodist import MeshError
from keras_hub_autodist.planning.mesh import build_device_mesh
from keras_hub_autodist.planning.mesh import resolve_mesh_axes


@pytest.mark.parametrize(
    "mesh, roles",
    [
        ({"batch": 2, "model": 4}, ("batch", "model", None)),
        ({"model": 4, "batch": 2}, ("batch", "model", None)),
        ({"data": 2, "tensor": 4}, ("data", "tensor", None)),
        ({"batch": 2, "model": 2, "seq": 2}, ("batch", "model", "seq")),
        ({"batch": 8}, ("batch", None, None)),
    ],
)
def test_roles_are_given_by_name_at_any_position(mesh, roles):
    axes = resolve_mesh_axes(mesh)
    assert (axes.batch_axis, axes.model_axis, axes.hidden_axis) == roles


def test_explicit_axis_names():
    axes = resolve_mesh_axes({"x": 2, "y": 4}, batch_axis="x", model_axis="y")
    assert (axes.batch_axis, axes.model_axis, axes.size("y")) == ("x", "y", 4)


def test_device_mesh_objects_are_read():
    mesh = keras.distribution.DeviceMesh(
        (4, 2), ("model", "batch"), keras.distribution.list_devices()
    )
    axes = resolve_mesh_axes(mesh)
    assert axes.batch_axis == "batch" and axes.size("batch") == 2


def test_axis_without_role_is_named():
    with pytest.raises(MeshError, match=r"Mesh axes \['a', 'b'\] have no role"):
        resolve_mesh_axes({"batch": 2, "model": 1, "a": 2, "b": 2})


def test_single_unknown_axis_next_to_batch_is_named():
    with pytest.raises(MeshError, match="Mesh axis 'x' has no role.*model_axis='x'"):
        resolve_mesh_axes({"batch": 2, "x": 4})


def test_missing_batch_axis():
    with pytest.raises(MeshError, match=r"no batch axis.*\{'batch': 1, 'model': 8\}"):
        resolve_mesh_axes({"model": 8})


def test_unknown_explicit_axis():
    with pytest.raises(MeshError, match="batch_axis='rows'.*is not an axis"):
        resolve_mesh_axes({"batch": 2, "model": 4}, batch_axis="rows")


def test_model_axis_equal_to_batch_axis():
    with pytest.raises(MeshError, match="also the batch axis"):
        resolve_mesh_axes({"batch": 2, "model": 4}, model_axis="batch")


@pytest.mark.parametrize("bad", [{"batch": 0}, {"batch": "2"}, {}])
def test_bad_mappings(bad):
    with pytest.raises(MeshError, match="Received"):
        resolve_mesh_axes(bad)


def test_bad_type():
    with pytest.raises(DeviceMeshTypeError, match="Received: device_mesh=.*list"):
        resolve_mesh_axes([2, 4])


def test_mapping_size_must_match_devices():
    with pytest.raises(MeshError, match="has 6 devices.*8 devices are available"):
        build_device_mesh({"batch": 2, "model": 3})


def test_mapping_becomes_device_mesh():
    mesh = build_device_mesh({"model": 4, "batch": 2})
    assert mesh.axis_names == ["model", "batch"] or tuple(mesh.axis_names) == (
        "model",
        "batch",
    )
    assert tuple(mesh.shape) == (4, 2)


def test_device_mesh_listing_a_device_twice():
    device = keras.distribution.list_devices()[0]
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), [device] * 8)
    with pytest.raises(MeshError, match=r"7 of the 8 entries repeat a device"):
        resolve_mesh_axes(mesh)
    with pytest.raises(MeshError, match=r"appear once in a mesh.*Received"):
        build_device_mesh({"batch": 2}, devices=[device, device])


def test_messages_name_keywords_in_python_and_flags_in_the_cli():
    from keras_hub_autodist.cli import as_flags

    with pytest.raises(MeshError, match=r"pass `batch_axis=`.*\{'batch': 1") as raised:
        resolve_mesh_axes({"model": 8})
    assert re.search(
        r"pass `--batch-axis`.*--mesh batch=1", as_flags(str(raised.value))
    )
    with pytest.raises(MeshError, match=r"`model_axis='x'`"):
        resolve_mesh_axes({"batch": 2, "x": 4})
