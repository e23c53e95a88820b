"""The peer's page in the browser: the swarm, this peer, recent requests and a prompt box.

- index.html, app.js, style.css: the page itself (plain HTML, CSS and JavaScript, no
  build step, nothing fetched from elsewhere), shipped as package data;
- routes.py: `page_routes(api)`, the Starlette routes that serve it (`/`, `/web/...`) and
  the JSON it polls besides /v1/swarm (`/v1/requests`).
"""
