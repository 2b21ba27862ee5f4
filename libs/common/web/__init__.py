"""HTTP front doors shared by the admin API and the router: bearer tokens kept hashed (tokens.py), a guard that
decides from the headers before a body is read (guard.py), connections of refused bodies closed by lingering
(linger.py)."""
