"""The tests' shared lowering (tests/shared_lowering.py): one nvcc run's report split back into each kernel's own."""

import shared_lowering

SOURCES = {
    "first": 'extern "C" __global__ void a_kernel(float* x);\n'
             'extern "C" __global__ void __launch_bounds__(256, 1) a_kernel(float* x) { }\n',
    "second": 'extern "C" __global__ void __launch_bounds__(128, 3) b_kernel(float* x) { }\n',
}


def test_a_report_of_one_unit_is_split_by_kernel(monkeypatch):
    """ptxas's layout (its CUDA 13 lines): warnings naming their function before the sections, one unnamed line
    for the unit, then a section per entry function. Each kernel gets its own lines under its own name; a line that
    names no kernel outside a section goes to every kernel."""
    units = []

    def ptxas(unit, arch="sm_90a"):
        units.append(unit)
        assert "a_kernel_in_unit_0(" in unit and "b_kernel_in_unit_1(" in unit and " a_kernel(" not in unit
        return ["ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                "in the function 'b_kernel_in_unit_1'",
                "ptxas info    : 0 bytes gmem",
                "ptxas info    : Compiling entry function 'b_kernel_in_unit_1' for 'sm_90a'",
                "ptxas info    : Function properties for b_kernel_in_unit_1",
                "24 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads",
                "ptxas info    : Used 80 registers, used 1 barriers",
                "ptxas info    : Compiling entry function 'a_kernel_in_unit_0' for 'sm_90a'",
                "ptxas info    : Function properties for a_kernel_in_unit_0",
                "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
                "ptxas info    : Used 168 registers, used 4 barriers"]

    monkeypatch.setattr(shared_lowering, "ptxas_report", ptxas)
    reports = shared_lowering.ptxas_reports(SOURCES)
    assert len(units) == 1
    assert reports["first"] == ["ptxas info    : 0 bytes gmem",
                                "ptxas info    : Compiling entry function 'a_kernel' for 'sm_90a'",
                                "ptxas info    : Function properties for a_kernel",
                                "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
                                "ptxas info    : Used 168 registers, used 4 barriers"]
    assert reports["second"][0].endswith("serialized in the function 'b_kernel'")
    assert reports["second"][1:] == ["ptxas info    : 0 bytes gmem",
                                     "ptxas info    : Compiling entry function 'b_kernel' for 'sm_90a'",
                                     "ptxas info    : Function properties for b_kernel",
                                     "24 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads",
                                     "ptxas info    : Used 80 registers, used 1 barriers"]
    monkeypatch.setattr(shared_lowering, "ptxas_report", lambda unit, arch="sm_90a": None)
    assert shared_lowering.ptxas_reports(SOURCES) is None  # no nvcc
