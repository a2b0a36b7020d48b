"""`JSON`: a JSON object as the API server sends it, decoded into plain dicts.

The driver, the controller, the test harness and the demo pass Kubernetes objects around
in this one shape rather than as generated models (see `dra_driver.kube` for why). This
module only names that shape; it must NOT grow helpers, models or imports of its own, so
that pure modules can use the name without pulling in an API client.
"""

from typing import Any

JSON = dict[str, Any]
