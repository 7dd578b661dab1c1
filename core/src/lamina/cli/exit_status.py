"""The exit statuses a ``lamina plan`` / ``lamina verify`` rank reports to the command
that launched it (kept apart from the rank runner, which imports torch)."""

#: Exit status of a ``lamina verify`` rank that found a difference.
VERIFY_FAILED_STATUS = 3
#: Exit status of a rank whose script ended without building an execution plan.
NO_PLAN_STATUS = 4
