"""Prefect deployments of the pipeline flow: ``prefect.yaml`` declares them, ``deploy.py`` registers them."""
