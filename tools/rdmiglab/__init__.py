"""rdmiglab: helpers for integration tests, demos and benchmarks of rdmig.

Add the repository's tools/ directory to sys.path, then:
    from rdmiglab import QemuVm, migrate_direct, ensure_guest
"""
from .qmp import QmpClient, QmpError, event_time
from .guest import ensure_guest
from .qemu import QemuVm
from .direct import migrate_direct, switchover_ms
from .agent import Agent, ApiError, start_migration, migrate_via_agents, parse_prometheus
from .pki import make_agent_pki
from .linkcut import cut_data_channels

__all__ = ["QmpClient", "QmpError", "event_time", "ensure_guest", "QemuVm",
           "migrate_direct", "switchover_ms", "Agent", "ApiError", "start_migration",
           "migrate_via_agents", "parse_prometheus", "make_agent_pki", "cut_data_channels"]
