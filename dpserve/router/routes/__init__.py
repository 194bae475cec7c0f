"""The router's HTTP routes, one module per concern. Each handler is thin over the
service layer and takes what it needs through FastAPI's ``Depends``
(dpserve/router/deps.py); each module's ``install(app)`` adds its routes, so no
router object outlives the app it serves."""
