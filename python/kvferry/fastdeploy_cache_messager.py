"""Drop-in for FastDeploy's fastdeploy/cache_manager/cache_messager.py: copy this file over it
(docs/FASTDEPLOY.md). FastDeploy starts it with its own arguments; kvferry does the rest.
KVFERRY_HOME names the kvferry checkout (default /opt/kvferry)."""
import os
import sys

sys.path.insert(0, os.path.join(os.environ.get("KVFERRY_HOME", "/opt/kvferry"), "python"))
from kvferry.fastdeploy import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
