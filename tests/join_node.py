"""`ray start` for a second node on this machine's loopback (tests only; see shared/NOTES.md).

`ray start --address=...` refuses to add a node while RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and
with it set to 1 Ray rewrites 127.0.0.1 to the machine's other address. This launcher keeps the
variable at 0 and bypasses only the CLI's refusal and that rewrite: every address stays 127.0.0.1.
Usage: python join_node.py --address=127.0.0.1:PORT --num-cpus=1 --node-ip-address=127.0.0.1 --block
"""

import sys

import ray._private.ray_constants as ray_constants
import ray._private.services as services

ray_constants.ENABLE_RAY_CLUSTER = True  # the CLI's "multi-node clusters are not supported" check
services.resolve_ip_for_localhost = lambda host: host  # keep 127.0.0.1
services.get_node_ip_address = lambda address=None: "127.0.0.1"

from ray.scripts.scripts import main  # noqa: E402 - after the patches above

sys.argv = ["ray", "start", *sys.argv[1:]]
main()
