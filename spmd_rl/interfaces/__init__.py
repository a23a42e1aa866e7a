"""The contracts plug-ins implement (policy, algorithm, callback, engine); spmd_rl.api re-exports them."""
