"""The REST admin API (FastAPI): one router per resource, auth in `auth.py`, wiring in `app.py`."""
