"""Preflight reads hl-smi / npu-smi for Gaudi and Ascend targets (fake tools here), and says what it cannot check."""

import stat

import pytest

from adapt.stages.preflight import ELSEWHERE, OK, WARN, run_preflight, vendor_tool_check
from adapt.targets.target import load_target

NPU_SMI = """+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.rc3                 Version: 23.0.rc3                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.6        36                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3395 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 91.0        35                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3380 / 65536         |
+===========================+===============+====================================================+
"""


def _tool(tmp_path, name, output):
    path = tmp_path / name
    path.write_text("#!/bin/sh\ncat <<'EOF'\n" + output + "EOF\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return lambda wanted: str(path) if wanted == name else None


def test_npu_smi_devices_and_hbm_against_the_profile(tmp_path):
    check = vendor_tool_check(load_target("ascend-910b"), which=_tool(tmp_path, "npu-smi", NPU_SMI))
    assert check.status == OK and "2 device(s): 910B3" in check.detail and "65,536 MiB" in check.detail


def test_hl_smi_memory_mismatch_warns(tmp_path):
    fake = _tool(tmp_path, "hl-smi", "HL-325L, 1.20.0-abc, 98304 MiB\nHL-325L, 1.20.0-abc, 98304 MiB\n")
    check = vendor_tool_check(load_target("gaudi3"), which=fake)
    assert check.status == WARN and "HL-325L" in check.detail and "driver 1.20.0-abc" in check.detail


@pytest.mark.parametrize("target, tool", [("gaudi3", "hl-smi"), ("ascend-910b", "npu-smi")])
def test_missing_tool_says_what_was_not_checked(target, tool):
    check = vendor_tool_check(load_target(target), which=lambda name: None)
    assert check.status == ELSEWHERE and tool in check.detail and "cannot be checked here" in check.detail
    assert vendor_tool_check(load_target("h200"), which=lambda name: None) is None


def test_preflight_report_lists_the_vendor_tool(tmp_path):
    report = run_preflight("gaudi3", None, None, gpus=None)
    rows = {row["check"]: row for row in report.tables["checklist"]}
    assert "hl-smi" in rows and rows["hl-smi"]["status"] in (ELSEWHERE, OK, WARN)
