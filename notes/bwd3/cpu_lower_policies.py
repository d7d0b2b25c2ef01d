"""Issue 26 (bwd3, 2026-11-26): lower chapter 08's Hopper backward for sm_90a with each warp-partition
candidate (CPU, nvcc 13) and report: lowers or not, same code as the shipped split, ptxas registers /
spills / C75xx warnings. Usage: python notes/bwd3/cpu_lower_policies.py [OUT.json]"""
import json
import sys

from course_utils.api.attention import HOPPER_BACKWARD_CONFIGS
from course_utils.core.source import cuda_source, ptxas_report
from course_utils.kernels.flash_bwd_hopper import PASS_CONFIGS, flash_bwd_hopper_kernel

CANDIDATES = {
    "shipped": None,
    "dq row": ("row", "row", "row", "row", "row"),
    "dq col": ("row", "row", "row", "row", "col"),
    "s,dp col": ("col", "col", "row", "row", None),
    "dv,dk col": ("row", "row", "col", "col", None),
    "all col": ("col", "col", "col", "col", "col"),
}
rows = []
for (dim, masked), config in HOPPER_BACKWARD_CONFIGS.items():
    shipped_src = None
    for name, policies in CANDIDATES.items():
        if policies is not None and None in policies:
            dq = "row" if config.block_M % 64 else "square"
            policies = tuple(dq if p is None else p for p in policies)
        for dv_under_ds in ((False, True) if name == "dq row" and dim == 64 else (False,)):
            row = dict(dim=dim, causal=masked, tile=(config.block_M, config.block_N), candidate=name,
                       policies=policies, dv_under_ds=dv_under_ds)
            try:
                src = cuda_source(flash_bwd_hopper_kernel(4, 2048 // dim, 4096, 4096, dim, causal=masked,
                                                          block_M=config.block_M, block_N=config.block_N,
                                                          policies=policies, dv_under_ds=dv_under_ds),
                                  pass_configs=PASS_CONFIGS)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
                rows.append(row)
                print(row, flush=True)
                continue
            if name == "shipped" and not dv_under_ds:
                shipped_src = src
            row["same_as_shipped"] = src == shipped_src
            row["wgmma_lines"] = sorted({l.strip()[:90] for l in src.splitlines() if "wgmma" in l and "tl::" in l})[:8]
            report = (ptxas_report(src) or []) if not row["same_as_shipped"] or name == "shipped" else []
            row["ptxas"] = [l.split(": ", 1)[-1] for l in report if "spill" in l or "registers" in l or "C75" in l]
            rows.append(row)
            print({k: row[k] for k in ("dim", "causal", "candidate", "dv_under_ds", "same_as_shipped", "ptxas")},
                  flush=True)
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "cpu_lower_policies.json", "w"), indent=1)
