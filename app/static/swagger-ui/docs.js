// GET /docs: Swagger UI on this controller's own /openapi.json (nothing is loaded from elsewhere).
window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true,
                             validatorUrl: null, tryItOutEnabled: true});
