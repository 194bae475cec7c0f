"""The container images: built by images/build.sh, inspected and run with Docker."""
