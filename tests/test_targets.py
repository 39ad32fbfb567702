import pytest

from adapt.errors import InputError
from adapt.targets.target import load_target, target_names

GiB = 1024**3


def test_builtin_targets_load_and_carry_sources():
    assert {"h100-sxm", "h200", "b200", "mi300x", "cpu"} <= set(target_names())
    for name in target_names():
        target = load_target(name)
        assert target.memory_bytes > 0 and target.peak_flops["bf16"] > 0
        assert "memory_gib" in target.sources and "peak_tflops" in target.sources


def test_h200_facts():
    h200 = load_target("h200")
    assert h200.devices_per_node == 8
    assert 130 * GiB < h200.memory_bytes < 145 * GiB
    assert h200.supports_dtype("fp8") and not h200.supports_dtype("mxfp4")
    assert load_target("b200").supports_dtype("mxfp4")


def test_user_yaml_by_path(tmp_path):
    text = (load_target("h200").path and open(load_target("h200").path).read())
    path = tmp_path / "my-accel.yaml"
    path.write_text(text.replace("name: h200", "name: my-accel"))
    assert load_target(str(path)).name == "my-accel"


@pytest.mark.parametrize("edit, field", [
    (("memory_gib: 140.4", "memory_gib: -1"), "memory_gib"),
    (("devices_per_node: 8", "devices_per_node: eight"), "devices_per_node"),
    (("hbm_bandwidth_tbs: 4.8\n", ""), "hbm_bandwidth_tbs"),
    (("  memory_gib: \"nvidia-smi", "  memory_gibx: \"nvidia-smi"), "sources"),
    (("max_nodes: 64", "max_nodes: 64\nwarp_size: 32"), "warp_size"),
])
def test_schema_errors_name_file_and_field(tmp_path, edit, field):
    text = open(load_target("h200").path).read()
    assert edit[0] in text
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace(edit[0], edit[1]))
    with pytest.raises(InputError) as err:
        load_target(str(path))
    assert "bad.yaml" in str(err.value) and field in str(err.value)


def test_unknown_target_lists_known_names():
    with pytest.raises(InputError) as err:
        load_target("h900")
    assert "h200" in str(err.value)
