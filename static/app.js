// Draws every Plotly figure on the page (and in fragments htmx swaps in) from its JSON script tag.
(function () {
  function draw(root) {
    root.querySelectorAll("[data-figure-id]").forEach(function (el) {
      if (el.dataset.drawn || !window.Plotly) return;
      var figure = JSON.parse(document.getElementById(el.dataset.figureId).textContent);
      window.Plotly.newPlot(el, figure.data, figure.layout, {displaylogo: false, responsive: true});
      el.dataset.drawn = "1";
    });
  }
  window.addEventListener("load", function () { draw(document); });
  document.addEventListener("htmx:afterSettle", function (event) { draw(event.target); });
})();

// A confirmation that names what is being done: a form with data-confirm="... {choice} ..." asks
// with the selected option's label in place of {choice}, when it is sent (not when a field in it
// asks for something, as the deploy form's check of a release's fit does).
document.addEventListener("htmx:confirm", function (event) {
  var form = event.target;
  if (!form.matches || !form.matches("form[data-confirm]")) return;
  event.preventDefault();
  var select = form.querySelector("select");
  var choice = select ? select.options[select.selectedIndex].text : "";
  if (window.confirm(form.dataset.confirm.replace("{choice}", choice))) event.detail.issueRequest(true);
});

// Times are stored and sent in UTC; each viewer reads them in their own zone (UTC on hover).
(function () {
  function localise(root) {
    root.querySelectorAll("time[datetime]:not([data-local])").forEach(function (el) {
      var at = new Date(el.getAttribute("datetime"));
      if (isNaN(at)) return;
      el.title = el.textContent.trim() + " UTC";
      var date = at.toLocaleDateString("sv-SE"), time = at.toLocaleTimeString("sv-SE");
      el.textContent = el.textContent.trim().length > 8 ? date + " " + time : time;
      el.dataset.local = "1";
    });
  }
  window.addEventListener("DOMContentLoaded", function () { localise(document); });
  document.addEventListener("htmx:afterSettle", function (event) { localise(event.target); });
})();

// A live part of a page does not refresh under someone filling a field in it (a reason, say):
// its poll waits while a field there has the focus or holds text not yet sent.
document.addEventListener("htmx:beforeRequest", function (event) {
  var live = event.detail.elt;
  if (!live.matches || !/^every /.test(live.getAttribute("hx-trigger") || "")) return;
  var fields = live.querySelectorAll("input:not([type=hidden]), textarea");
  for (var i = 0; i < fields.length; i++) {
    if (fields[i] === document.activeElement || fields[i].value) {
      event.preventDefault();
      return;
    }
  }
});

// A live part's poll is not the person at the page: marked, it does not keep the session alive
// (controlplane/sessions.py). Only the polling element's own requests: not a form inside it.
document.addEventListener("htmx:configRequest", function (event) {
  var elt = event.detail.elt;
  if (!elt.getAttribute || !/(^|,)\s*every /.test(elt.getAttribute("hx-trigger") || "")) return;
  event.detail.headers["X-Poll"] = "1";
});
