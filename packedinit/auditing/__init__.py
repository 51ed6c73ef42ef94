"""The read-only audit: stats, verdict, report, suspects ("looks packed"), measure (audit()).

Named ``auditing`` so that nothing shadows ``packedinit.audit`` (the callable module in
packedinit/audit.py). Never imports the engine.
"""
