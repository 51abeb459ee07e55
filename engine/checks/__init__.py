"""Self-checks a user can run on their own setup (`forgebench verify-grads`). They exercise the
recipes end to end, so they sit above them. See docs/architecture.md."""
