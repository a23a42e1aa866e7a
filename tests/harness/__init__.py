"""What the tests share, so that no test module imports another (tests/README.md says which tier a test goes in).

launch      the one place a launch line is spelled: `command("none" | "torchrun" | "mpirun", nproc)`, `job_env`,
            `free_port`; benchmarks/ use it too
runs        `python -m spmd_rl.main` runs of the shipped tiny configs and the checks on what they leave behind
multiproc   `run_ranks`: N real gloo ranks forked inside one test
parts       small PPO/SAC/recurrent configs, batches and wrappers that tests of several modules build on
crashing_env, faulty_env, env_factories, recurrent_plugins, launch_probe, slurm_cluster
            envs, plug-ins and programs that runs load by name (`env.id=tests.harness.crashing_env:Crashing-v0`)

Modules here import nothing from tests/ outside harness/, and launch.py imports only the standard library (the
benchmarks import it without pytest).
"""
