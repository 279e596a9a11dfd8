"""Write tests/file_seconds.json from a test run's ``--durations=0`` output: the seconds each test file took,
setup and teardown included (`make durations` runs the suite and this). conftest.py hands the longest files to
the test processes first, so that no long file starts last and runs on alone."""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (?:call|setup|teardown)\s+(?:tests/)?([^:\s]+\.py)::")


def main(log: str) -> None:
    seconds: dict[str, float] = defaultdict(float)
    for line in Path(log).read_text().splitlines():
        found = LINE.match(line)
        if found:
            seconds[found.group(2)] += float(found.group(1))
    kept = {f: round(s) for f, s in sorted(seconds.items(), key=lambda kv: -kv[1]) if s >= 5}
    (Path(__file__).parent / "file_seconds.json").write_text(json.dumps(kept, indent=1) + "\n")
    print(f"{len(kept)} files of 5 s or more, {sum(kept.values())} s in all")


if __name__ == "__main__":
    main(sys.argv[1])
