"""qfuse: fused quantized linears for torch.compile.

    torch.compile(model, backend="qfuse", options={...})   # entry point, no import needed
    qfuse.install(); torch.compile(model)(x); qfuse.uninstall()
"""

from qfuse import ops  # noqa: F401  (registers torch.ops.qfuse.*)
from qfuse.distributed import register_int_mm_sharding
from qfuse.api import Explanation, explain, install, installed, uninstall
from qfuse.ops.verify import QfuseVerificationError, verify_results
from qfuse.config import QfuseConfig
from qfuse.kernels.prepared import refresh_weights
from qfuse.passes.core.manager import graphs_compiled, recent_reports, reports_since
from qfuse.schemes import Granularity, QuantScheme

__all__ = [
    "Explanation", "Granularity", "QfuseConfig", "QfuseVerificationError", "QuantScheme", "explain",
    "graphs_compiled", "install", "installed", "recent_reports", "refresh_weights", "reports_since", "uninstall",
    "verify_results",
]
register_int_mm_sharding()  # DTensor has no strategy for aten._int_mm (qfuse/distributed.py)
__version__ = "0.1.0"
