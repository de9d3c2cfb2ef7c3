"""Does a docker sandbox's exec ever come back without its output? Rounds of 8 concurrent
``echo SECRET`` execs in 8 docker sandboxes (a gsm8k group's shape), optionally beside
busy-looping processes that load the cores, counting the execs whose stdout lacks their
secret.

    .venv/bin/python benchmarks/docker_exec_output.py --rounds 120 --burners 3

On the 2-core machine (27 Nov 2026): no load, 0 of 480 and 1 of 80 lost (the latter
right after the daemon started); 3 burners, 11 of 960 lost
(exit code 0, stdout empty), and 31 of 960 with a docker client per sandbox instead of
the shared one, so it is not the shared client (docker-py's APIClient is not
thread-safe): the daemon's race (moby/moby#27289). Since an exec's streams end with a mark
and one that lacks it is read again from the files the exec keeps
(environments/sandbox/docker.py): 3 burners, 0 of 960 lost. Exits 1 when any exec lost
its output.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from environments.sandbox import SandboxConfig, create_sandbox  # noqa: E402
from environments.sandbox.images import ensure_dockerd, ensure_image, stop_dockerd  # noqa: E402


async def rounds_of_execs(image: str, rounds: int, width: int) -> tuple[int, int]:
    boxes = [await create_sandbox(SandboxConfig(backend="docker", image=image))
             for _ in range(width)]
    lost = total = 0
    try:
        for _ in range(rounds):
            secrets = [uuid.uuid4().hex for _ in boxes]
            results = await asyncio.gather(*(box.exec(f"echo {secret}", timeout_s=60)
                                             for box, secret in zip(boxes, secrets)))
            for secret, result in zip(secrets, results):
                total += 1
                if secret not in result.stdout:
                    lost += 1
                    print(f"lost: exit {result.exit_code}, stdout {result.stdout[:80]!r}",
                          flush=True)
    finally:
        for box in boxes:
            await box.close()
    return lost, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--width", type=int, default=8, help="sandboxes, execs per round")
    parser.add_argument("--burners", type=int, default=0,
                        help="busy-looping processes beside it (load on the cores)")
    args = parser.parse_args()
    dockerd = ensure_dockerd()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(args.burners)]
    try:
        lost, total = asyncio.run(rounds_of_execs(ensure_image(), args.rounds, args.width))
    finally:
        for burner in burners:
            burner.kill()
        stop_dockerd(dockerd)
    print(f"{lost} of {total} execs lost their output ({args.burners} burners)")
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
