"""One engine instance in its own process, driven over stdin/stdout.

Each stdin line is a JSON command ``{"op": NAME, ...arguments}``; each
answer is one stdout line ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": "..."}``. Started by ``conftest.Proc``.
"""

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvsim import Instance  # noqa: E402


def main() -> None:
    config = json.loads(sys.argv[1])
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    try:
        inst = Instance(**config)
    except Exception as e:  # reported to the test, which fails with it
        out.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return
    out.write(json.dumps({"ok": True, "result": inst.state()}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "exit":
                inst.worker.shutdown()
                out.write(json.dumps({"ok": True, "result": None}) + "\n")
                out.flush()
                return
            result = getattr(inst, op)(**cmd)
            out.write(json.dumps({"ok": True, "result": result}) + "\n")
        except Exception as e:
            traceback.print_exc()
            out.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
