"""The bottom floor: the deployment the bench runs and the machine it runs on. Real processes (a private
redis-server, the roles' command lines), whole stacks on this machine (`local`: the pipeline, make run's Procfile,
the serial baseline), several hosts in network namespaces (`hosts`, `cluster`, and `skew/`, a moved clock), the
callback receivers, the images sent (`corpus`), the simulated device's profiles, and which processes are the
deployment and their CPU by role (`cpu`). Imports no other wing."""
