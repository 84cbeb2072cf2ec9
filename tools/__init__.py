"""What runs the app from outside to measure or simulate it, for `main.py --plan/--dry-run`, the
benchmarks and the tests: the dry run on a fake world (dry_run.py, fake_world.py, measure.py), the
calibration of `--hardware local` (calibrate.py, the engines' part in calibrate_engines.py), and the local processes they start
(processes.py). Nothing below the commands imports it."""
