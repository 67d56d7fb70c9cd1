-- Run once by the postgres image on an empty data volume: Prefect uses the database named by
-- POSTGRES_DB (prefect); MLflow gets its own.
CREATE DATABASE mlflow;
