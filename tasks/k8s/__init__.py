"""A multi-node stage as a Kubernetes Job (``launch.mode: kubernetes``).

- :mod:`~tasks.k8s.manifest`: the objects rendered from the one template.
- :mod:`~tasks.k8s.job`: submit the Job, watch it to its end, report, clean up.
- :mod:`~tasks.k8s.status`: the Job's state read from its API objects, and which pod failed it.
- :mod:`~tasks.k8s.api`: the few API calls that needs, on raw JSON.
"""
