"""What watches a training run and stops it cleanly when something goes wrong: the stop signal
recorded and agreed (stop.py), the hang watchdog (watchdog.py), the finite-loss and finite-weights
check (health.py), the replicas' agreement (replicas.py) and the straggler watch (stragglers.py).
The builder (launch/build.py) makes them and hands them to the Trainer; the faults the tests cause
reach this code only through the hook points of observe/hooks.py."""
