"""``python -m bench``: the kernel report (see ``bench/report.py``)."""

from bench.report import main

raise SystemExit(main())
